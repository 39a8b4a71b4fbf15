"""Operations routes: /health, /info and /metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from app.api.deps import get_metrics, get_runtime, get_settings
from app.api.schemas import ErrorResponse, Health, Info
from app.service.metrics import Metrics
from app.service.runtime import Runtime
from app.service.settings import Settings

router = APIRouter(tags=["operations"])


@router.get(
    "/health",
    response_model=Health,
    responses={
        503: {
            "model": Health,
            "description": "the model is loading or failed to load, the worker is gone (restart the server), or "
            "the server is draining for a shutdown",
        }
    },
    summary="Readiness and liveness",
)
async def health(request: Request) -> JSONResponse:
    """200 once the models are loaded and the worker runs; 503 before, if loading failed, if the worker is
    gone, and while the server drains for a shutdown."""
    state = request.app.state
    if state.draining:
        return JSONResponse(Health(status="draining").model_dump(), status_code=503)
    if state.runtime is not None:
        failure = state.runtime.scheduler.failure
        if failure is not None:
            return JSONResponse(Health(status="failed", error=failure).model_dump(), status_code=503)
        return JSONResponse(Health(status="ok").model_dump())
    if state.load_error:
        return JSONResponse(Health(status="failed", error=state.load_error).model_dump(), status_code=503)
    return JSONResponse(Health(status="loading").model_dump(), status_code=503)


@router.get(
    "/info",
    response_model=Info,
    responses={503: {"model": ErrorResponse, "description": "the model is loading"}},
    summary="The served models and the limits",
)
async def info(
    runtime: Annotated[Runtime, Depends(get_runtime)], settings: Annotated[Settings, Depends(get_settings)]
) -> Info:
    """Models, dtype, device, draft, k, limits and version."""
    i = runtime.info
    prefix_limit, prefix_used = runtime.prefix_cache_bytes
    index_limit, index_used, index_answers = runtime.suffix_index
    # Every tenant's key reads /info: what the caches hold now, read before and after another tenant's request,
    # is the size of its prompt and its answer. The limits are configuration, and stay.
    private = bool(settings.named_api_keys)
    return Info(
        model_id=i.model_id,
        served_model_name=i.served_model_name,
        served_model_names=list(i.served_model_names),
        model_dtype=i.dtype,
        model_device_type=i.device,
        model_weights=i.weights,
        model_weight_bytes=i.weight_bytes,
        cpu_kernel=i.kernel,
        batched_decoding=i.batched_decoding,
        draft=i.default_draft,
        available_drafts=list(i.drafts),
        num_draft_tokens=i.num_draft_tokens,
        draft_schedule=i.draft_schedule,
        draft_p_min=i.draft_p_min,
        max_input_tokens=i.max_input_tokens,
        max_new_tokens=settings.max_new_tokens,
        max_total_tokens=i.context_length,
        max_stop_sequences=settings.max_stop_sequences,
        max_concurrent_requests=settings.max_concurrent_requests,
        kv_cache_memory_bytes=runtime.scheduler.kv_budget,
        max_queue_size=settings.max_queue_size,
        prefix_cache_bytes=prefix_limit,
        prefix_cache_used_bytes=None if private else prefix_used,
        suffix_index_bytes=index_limit,
        suffix_index_used_bytes=None if private else index_used,
        suffix_index_answers=None if private else index_answers,
        request_timeout=settings.request_timeout,
        version=i.version,
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {}}}},
    summary="Prometheus metrics",
)
async def metrics(metrics: Annotated[Metrics, Depends(get_metrics)]) -> Response:
    """Every metric, prefix ``specserve_``, in the Prometheus text format."""
    return Response(metrics.render(), media_type=metrics.content_type)
