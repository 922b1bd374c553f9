"""The native engine served: the resident model, its thread bridge, its answers and its service."""
