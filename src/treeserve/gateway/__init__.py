"""`treeserve gateway`: an OpenAI-compatible front door with accounts, keys, budgets and billing in
a database, routing across replicas of each model. It reaches its backends over their APIs only
(HTTP, or a RabbitMQ queue of workers) and never imports the engine, the server or PyTorch: what it
shares with the server (error bodies, request models, the broker's messages, the drain) is in
`treeserve.wire` (tests/test_layering.py holds it to that)."""
