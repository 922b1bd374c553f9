"""bankml's version, in a module of its own so that any module can import it without the
package's ``__init__``."""

__version__ = "0.1.0"
