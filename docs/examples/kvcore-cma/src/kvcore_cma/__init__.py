"""kvcore-cma: an example kvcore transport over Linux cross-memory attach (process_vm_writev/readv)."""

__version__ = "0.1.0"
