"""A request's engine streams merged for its reader: each prompt's outputs, from its own Serve
call or from the output channel it was routed to (`output_channel`), as what is ready at each
pull. The OpenAI endpoints and the Responses runner read their engine outputs through it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from actors.outputs import RequestOutput
from serve_app.workers.output_channel import EngineChannels, Mailbox

logger = logging.getLogger(__name__)

# Every (prompt index, output) the merged engine streams had ready at one pull, in arrival
# order; `(-1, None)` alone is the deadline.
Ready = list[tuple[int, RequestOutput | None]]
Merged = AsyncIterator[Ready]
# The deadline's marker in a merge's queue (compared by identity).
_EXPIRED = (-1, None)


async def merged_outputs(
    streams: list,
    boxes: list[Mailbox],
    firsts: list[RequestOutput],
    deadline: float | None,
    channels: EngineChannels,
) -> Merged:
    """Every prompt's outputs from its stream or channel mailbox, as what is ready at each
    pull (never waiting for more than the first), ending at the deadline. A prompt ends only
    with its last output: an engine call that stops short of it ends the prompt as
    `engine_lost`, never as a short success and never as a wait for what will not come."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    def deliver(i: int, out: RequestOutput) -> None:
        queue.put_nowait((i, out))
        if out.finished:
            queue.put_nowait((i, None))

    async def pump(i: int, gen, box: Mailbox) -> None:
        # The call's outputs go through the mailbox too: it takes nothing after the last.
        box.attach(lambda out: deliver(i, out))
        try:
            async for out in gen:
                box.put(out)  # channelled: nothing more, unless its channel closed under it
        except (Exception, asyncio.CancelledError) as exc:
            if asyncio.current_task().cancelling():
                # The reader left (the merge is closing): nothing more is wanted. The handle
                # may answer that cancel with its own RequestCancelledError: the same end,
                # and no one awaits this task to retrieve it.
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            # The replica or its worker died, or Serve cancelled the call under its reader
            # (it cancels a leaving client's handle calls before its writer hears of it,
            # and raises CancelledError in whoever reads them). The engine request is gone
            # either way, and nothing it started is re-run elsewhere.
            if isinstance(exc, asyncio.CancelledError):
                logger.info("engine call cancelled under its reader (its client left?)")
                box.fail("the engine call was cancelled")
            else:
                logger.error("engine stream lost: %s", type(exc).__name__)
                box.fail("the engine replica was lost")
            return
        if box.instance is None:  # unchannelled: the call's end is the request's end
            box.fail("the engine stream ended before the request finished")

    pending = 0
    tasks = []
    for i, (gen, box, first) in enumerate(zip(streams, boxes, firsts, strict=True)):
        await queue.put((i, first))
        if not first.finished:
            pending += 1
            tasks.append(asyncio.create_task(pump(i, gen, box)))
    # One timer for the request that queues its marker at the deadline, rather than a
    # timeout around every pull (a task and a timer per token).
    expiry = None
    if deadline is not None:
        loop = asyncio.get_running_loop()
        expiry = loop.call_at(loop.time() + deadline - time.monotonic(), queue.put_nowait, _EXPIRED)
    try:
        while pending or not queue.empty():
            item = await queue.get()
            ready: Ready = []
            expired = False
            while True:  # and whatever else came meanwhile (the writer fell behind)
                if item is _EXPIRED:
                    expired = True
                elif item[1] is None:
                    pending -= 1
                else:
                    ready.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if ready:
                yield ready
            if expired and pending:
                yield [(-1, None)]  # deadline: the caller ends the open choices
                return
    finally:
        if expiry is not None:
            expiry.cancel()
        for task in tasks:
            task.cancel()
        for gen in streams:
            gen.cancel()
        for box in boxes:
            channels.release(box.request_id)
