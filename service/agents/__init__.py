"""External agents: episodes played by an agent written against the OpenAI API (env `external`),
recorded with the same exactness as the service's own loop."""
