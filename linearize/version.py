"""The package version, in a module of its own: the model code (whose bundled copy gets it as a value, see
:data:`linearize.bundle.CONSTANTS`), the output markers and the command line read it without importing the
package's ``__init__``, which imports the model code."""

__version__ = "0.1.0"
