"""The proposers: one module per guesser, and the registry's loader (docs/layout.md)."""
