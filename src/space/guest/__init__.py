"""The guest side of SPACE: the agent that runs inside every VM and its wire protocol.

Standard library only: these files are copied into the VM at boot, so any template with a
python3 can carry them. Nothing here may import from the rest of `space`.
"""
