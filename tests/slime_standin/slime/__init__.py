"""Stand-in for slime (see tests/slime_standin/README.md)."""
