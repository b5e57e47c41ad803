"""`python -m llmhealth` runs the command line."""

from llmhealth.cli import main

main()
