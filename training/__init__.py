"""Training on byte-level text: data, steps, the run loop and the command line."""
