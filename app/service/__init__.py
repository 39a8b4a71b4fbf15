"""The service around the engine: the scheduler (the worker thread that steps the engine), its admission policy
and the events it hands the routes, the runtime the routes read, metrics, settings and logs. It imports nothing of
app/api: the app that serves it is app.api.server."""
