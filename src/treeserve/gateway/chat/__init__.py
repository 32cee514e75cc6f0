"""The web chat served by the gateway at /chat: sign-in, conversations kept in the gateway's
database, answers streamed from its models (plain, by PRM-guided search, or through a tool)."""
