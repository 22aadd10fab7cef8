"""The demos (`gram-haiku demo`, `gram-haiku dp-demo`, `gram-haiku attribution-demo`): applications of the public API, outside the library."""
