"""Training: learns guessers for a frozen target (PPD prompt tokens, drafters). Imports the decoder's
guesser modules, never the reverse."""
