"""Target engines, one subpackage each (docs/layout.md)."""
