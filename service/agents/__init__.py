"""External agents: episodes played by an agent written against an LLM API (env `external`),
recorded with the same exactness as the service's own loop.

    routes.py            the router: each protocol's, and POST .../finish (every agent's)
    chat_completions.py  OpenAI Chat Completions: its request, response, stream and route
    anthropic_messages.py  Anthropic Messages (blocks, thinking, its events and error shape)
    openai_responses.py  OpenAI Responses (items, previous_response_id, its events)
    deps.py              the HTTP edge: the episode a request opens (its token checked), the
                         one table of the domain's errors as HTTP errors, a streamed answer
    streaming.py         a streamed call: sampled ids as the text to show so far, the agent leaving
    schemas.py           the bodies every protocol shares (finish)
    service.py           load, answer, store, the stale-cache retry; what this process holds
    session.py           one call answered and recorded exactly (engine, tokenizer, parser)
    conversation.py      a call and its answer in no protocol's shape; continuing a segment
    repository.py        the episode's reads and writes
    errors.py            why a call is refused, in the domain's terms (no HTTP status)

Only routes.py, deps.py, schemas.py and the protocol modules import service.api; the rest imports
nothing above loop, engine and storage, and storage imports nothing of this package.

Another protocol is one module beside chat_completions.py:
its request model turned into a `ChatCall` (messages in the chat-template shape the conversation
records), its route (`WaitingEpisode`, then `services.agents.complete` inside `with http_errors`), and
its response built from the `Answer`'s fields; then one `router.include_router(...)` line in
routes.py. Sessions, segments, storage and the token accounting are shared, so an agent may even
switch protocols mid-episode.
"""
