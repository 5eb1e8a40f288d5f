"""Why an external agent's call is not answered, in the domain's terms: the HTTP edge
(service/agents/deps.py) maps each to its status, in one table."""

from __future__ import annotations


class AgentError(Exception):
    """A call or a finish this domain refuses; its message is what the agent reads."""


class UnknownEpisode(AgentError):
    """No such episode, or it is not one an external agent plays."""


class EpisodeClosed(AgentError):
    """The episode takes no more calls: it ended, spent its turns or tokens, or another call (or a
    cancel, or the idle timeout) got there first."""


class EngineRefused(AgentError):
    """The engine refused the request (e.g. the conversation outgrew the model's context)."""


class EngineUnavailable(AgentError):
    """The engine failed or aborted the call."""


class UnknownResponse(AgentError):
    """The call continues an earlier one (Responses' previous_response_id) the episode did not make."""
