"""The HTTP API: routes, wire formats, errors. It knows the scheduler, never a tensor."""
