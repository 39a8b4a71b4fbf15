"""The HTTP API: routes, wire formats, errors, and the app that composes them (server.py: `create_app`, the
lifespan, `serve`). It knows the scheduler, never a tensor."""
