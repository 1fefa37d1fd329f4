"""Scripts that compare policies and measure the system, each with its command (README.md)."""
