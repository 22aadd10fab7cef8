"""The demos (`gram-haiku demo`, `gram-haiku dp-demo`): applications of the public API, outside the library."""
