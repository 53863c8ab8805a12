"""`env.name=openai_agent`: agent code written against an OpenAI client drives whole sessions.

kind.py           the `openai_agent` kind: `env.agent` checked at load, the endpoint deployed and removed
session.py        agent sessions turned into trajectories (`AgentEpisodes`, `resolve_agent`)
openai_api.py     the OpenAI-compatible chat endpoint: a Ray Serve application beside the rollout deployment
openai_chat.py    the chat-completions protocol over token-in/token-out generation; session records
openai_routes.py  where the endpoint lives (application, deployment, route prefix): a leaf module
example.py        an example agent: the calculator task through an unmodified OpenAI client
"""
