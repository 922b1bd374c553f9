"""The gate: what a model file must pass before bankml serves it.

``guard`` reads the GGUF header and answers play, refuse or need_more; ``verify`` runs the guard,
then checks the whole file's sha256 against its pin in FORK.json; ``fileident`` names a file by
device, inode, size and mtime so a swapped file is noticed. No Twisted: the gate runs the same
from the command line, the Python API and both serving modes.
"""
