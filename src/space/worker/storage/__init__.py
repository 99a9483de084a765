"""Disks on a worker: copy-on-write clones of template images, and the pool they live in."""
