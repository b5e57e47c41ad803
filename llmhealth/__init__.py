"""llmhealth: health checks for LLM inference fleets that read the server's own metrics first."""

__version__ = "0.1.0"
