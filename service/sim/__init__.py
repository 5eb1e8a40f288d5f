"""A simulated SGLang worker, for trying the service out and for tests: not part of the product."""
