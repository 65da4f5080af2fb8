"""Health checks run by each rank before every restart iteration (CUDA, NVML, user checks).

A host without a GPU or without NVML is *skipped* (logged once per checker), never unhealthy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from restartable.inprocess.protocol import fault_records
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.progress import ProgressTracker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_CUDA_TIMEOUT_S = 30.0  # a healthy device runs a tiny kernel in milliseconds; a wedged one never


class HealthChecker:
    """Owner of this rank's health checks; the restart loop calls ``check()`` before each iteration.

    Called from the main thread only, between iterations (never while ``train()`` runs). On a
    GPU host ``check()`` runs a small kernel and synchronises (bounded by ``cuda_timeout``), then
    asks NVML (nvidia-ml-py) whether the device is present and has pending retired pages,
    pending / failed row remaps, a recovery action, or a critical XID since the last check. Then
    each ``user_checks`` callable runs; one that raises makes the rank unhealthy with its
    message as the reason. ``close()`` releases NVML; it is idempotent.
    """

    def __init__(
        self,
        *,
        user_checks: Sequence[Callable[[], None]] = (),
        device: torch.device | None = None,
        empty_cuda_cache: bool = True,
        cuda_timeout: float = _CUDA_TIMEOUT_S,
    ) -> None:
        if cuda_timeout <= 0:
            raise ValueError(
                f"cuda_timeout ({cuda_timeout}) must be > 0: give the seconds a healthy device "
                "needs to run a tiny kernel (default 30)"
            )
        for check in user_checks:
            if not callable(check):
                raise TypeError(
                    f"user_checks holds {check!r}, which is not callable: pass functions that "
                    "take no arguments and raise when the rank is unhealthy"
                )
        self._user_checks = tuple(user_checks)
        self._device = device
        self._empty_cuda_cache = empty_cuda_cache
        self._cuda_timeout = cuda_timeout
        self._skip_logged = False
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded
        self._nvml_handle: Any = None
        self._xid_events: Any = None
        self._closed = False

    def check(self) -> str | None:
        """None when this rank is healthy, else every reason found, joined by "; "."""
        if self._closed:
            raise RuntimeError("HealthChecker.check() called after close(): create a new one")
        reasons: list[str] = []
        gpu = self._gpu_index()
        if gpu is None:
            self._log_skip("no CUDA device")
        else:
            if self._empty_cuda_cache:
                import torch

                # Memory the last iteration cached would otherwise stay reserved by a dead graph.
                torch.cuda.empty_cache()
            reasons += filter(None, [self._check_cuda(gpu), self._check_nvml(gpu)])
        for user_check in self._user_checks:
            try:
                user_check()
            except Exception as e:
                name = getattr(user_check, "__qualname__", repr(user_check))
                reasons.append(f"user health check {name} failed: {type(e).__name__}: {e}")
        if reasons:
            log.warning("rank unhealthy: %s", "; ".join(reasons))
        return "; ".join(reasons) or None

    def close(self) -> None:
        """Release NVML (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._nvml is not None:
            try:
                if self._xid_events is not None:
                    self._nvml.nvmlEventSetFree(self._xid_events)
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a broken NVML must not fail the rank's exit
                log.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None

    def __enter__(self) -> HealthChecker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- pieces -----------------------------------------------------------------------------

    def _log_skip(self, why: str) -> None:
        if not self._skip_logged:
            self._skip_logged = True
            log.info("GPU health checks skipped: no GPU / NVML (%s)", why)

    def _gpu_index(self) -> int | None:
        if self._device is not None and self._device.type != "cuda":
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        if self._device is not None and self._device.index is not None:
            return self._device.index
        return torch.cuda.current_device()

    def _check_cuda(self, index: int) -> str | None:
        import torch

        errors: list[BaseException] = []

        def probe() -> None:
            try:
                with torch.cuda.device(index):
                    x = torch.ones(16, device=f"cuda:{index}")
                    if float((x * 2).sum().item()) != 32.0:
                        raise RuntimeError("a tiny kernel returned a wrong result")
                    # A second sync surfaces a sticky error left by an earlier kernel.
                    torch.cuda.synchronize(index)
            except BaseException as e:  # reported as the reason, not raised
                errors.append(e)

        # Daemon: a wedged driver call cannot be interrupted; the rank is reported unhealthy
        # (and will be retired) instead of blocking the restart forever.
        t = threading.Thread(target=probe, name="inprocess-cuda-health", daemon=True)
        t.start()
        t.join(self._cuda_timeout)
        if t.is_alive():
            return f"CUDA device {index} did not run a tiny kernel within {self._cuda_timeout} s"
        if errors:
            return f"CUDA device {index} unusable: {type(errors[0]).__name__}: {errors[0]}"
        return None

    def _check_nvml(self, index: int) -> str | None:
        if self._nvml is None and not self._init_nvml(index):
            return None
        nvml = self._nvml
        handle = self._nvml_handle
        try:
            nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError as e:
            return f"GPU {index} not reachable through NVML: {e}"
        reasons = []
        pending = _optional(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle), nvml)
        if pending is not None and pending == nvml.NVML_FEATURE_ENABLED:
            reasons.append(f"GPU {index} has retired pages pending (needs a GPU reset)")
        remap = _optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle), nvml)
        if remap is not None:
            _corr, _unc, is_pending, failed = remap
            if is_pending:
                reasons.append(f"GPU {index} has row remaps pending (needs a GPU reset)")
            if failed:
                reasons.append(f"GPU {index} failed a row remap")
        action = self._recovery_action(handle)
        if action:
            reasons.append(f"GPU {index} NVML recovery action {action} (not NONE)")
        if self._xid_events is not None:
            xid = _optional(lambda: nvml.nvmlEventSetWait_v2(self._xid_events, 0), nvml)
            data: int = 0 if xid is None else getattr(xid, "eventData", 0)
            if data:
                reasons.append(f"GPU {index} reported critical XID {data}")
        return "; ".join(reasons) or None

    def _init_nvml(self, index: int) -> bool:
        try:
            import pynvml
        except ImportError:
            self._log_skip("nvidia-ml-py not installed")
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self._log_skip(f"nvmlInit failed: {e}")
            return False
        self._nvml = pynvml
        self._nvml_handle = self._nvml_handle_for(index)
        try:
            events = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(
                self._nvml_handle, pynvml.nvmlEventTypeXidCriticalError, events
            )
            self._xid_events = events
        except pynvml.NVMLError:  # XID events are not reported on every GPU / driver
            log.debug("NVML XID events unavailable", exc_info=True)
        return True

    def _nvml_handle_for(self, index: int) -> Any:
        import torch

        nvml = self._nvml
        # CUDA and NVML number devices differently under CUDA_VISIBLE_DEVICES: match the PCI id.
        props: Any = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            domain = getattr(props, "pci_domain_id", 0)
            dev = getattr(props, "pci_device_id", 0)
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{dev:02x}.0")
            except nvml.NVMLError:
                log.debug("NVML lookup by PCI id failed; using index %d", index, exc_info=True)
        return nvml.nvmlDeviceGetHandleByIndex(index)

    def _recovery_action(self, handle: Any) -> int:
        nvml = self._nvml
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return 0
        values = _optional(lambda: nvml.nvmlDeviceGetFieldValues(handle, [field]), nvml)
        if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
            return 0  # driver older than r570: not reported
        return int(values[0].value.uiVal)


def _optional(query: Callable[[], Any], nvml: Any) -> Any:
    """The query's answer, or None where this GPU / driver does not report it."""
    try:
        return query()
    except nvml.NVMLError:
        return None


def check_and_report(
    health: HealthChecker, store: Store, progress: ProgressTracker, *, me: int, iteration: int
) -> None:
    """The restart loop's health phase (main thread): before the first iteration and after
    every fault, before the restart barrier. An unhealthy rank records a fault of
    ``iteration`` in ``store``, and the restart decision retires it. ``progress`` (the rank's
    ``ProgressTracker``) is paused meanwhile: a slow check is not a hang."""
    with progress.paused():
        try:
            reason = health.check()
        except Exception as exc:  # a broken check is an unhealthy rank, not a dead job
            reason = f"health check raised {exc!r}"
    if reason is not None:
        log.warning("rank %d unhealthy before iteration %d: %s", me, iteration, reason)
        fault_records.report_fault(
            store, iteration=iteration, initial_rank=me, kind="unhealthy", detail=reason
        )
