"""Where the OpenAI-compatible front end lives: its Serve application, deployment and route prefix.

A leaf module: both the front end (app/agent/openai_api.py) and the agent sessions that call it
(app/agent/session.py) import these names from here, so neither imports the other.
"""

from __future__ import annotations

ROUTE_PREFIX = "/relay"
