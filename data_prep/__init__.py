"""Command-line tools that prepare data for powerclip (thin layers over `powerclip.parsing` and `powerclip.regions`)."""
