"""ember."""
