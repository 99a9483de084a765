"""VMM drivers behind one interface (`base`): QEMU microvm (`qemu`) and Firecracker."""
