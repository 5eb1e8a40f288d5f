"""Stand-in for AReaL at 4aef98d8d818af55b43621aaadba047ae10f4e77 (see ../README.md)."""
