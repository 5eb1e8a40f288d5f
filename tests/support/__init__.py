"""Helpers the test modules share: engine and env doubles, stub servers, the service as a process."""
