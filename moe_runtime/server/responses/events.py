"""The Responses event stream of one answer's items (`ItemEventLog`, an `ItemEvents` listener): every event
carries the stream's `sequence_number`; the lifecycle events (`response.created`, ...) are the formatter's."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.responses.output_items import OutputItem, output_text

DELTA_EVENTS = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                "function_call": "response.function_call_arguments.delta"}


@dataclass
class ItemEventLog:
    events: list[dict] = field(default_factory=list)   # not yet sent
    sequence_number: int = 0

    def event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    # ItemEvents
    def opened(self, index: int, item: OutputItem) -> None:
        self.event("response.output_item.added", output_index=index, item=item.body("in_progress"))
        if item.kind == "message":
            self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                       part=output_text(""))

    def grew(self, index: int, item: OutputItem, delta: str) -> None:
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "message":
            self.event(DELTA_EVENTS[item.kind], **where, content_index=0, delta=delta, logprobs=[])
        elif item.kind == "reasoning":
            self.event(DELTA_EVENTS[item.kind], **where, content_index=0, delta=delta)
        else:
            self.event(DELTA_EVENTS[item.kind], **where, delta=delta)

    def closed(self, index: int, item: OutputItem) -> None:
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "message":
            self.event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[])
            self.event("response.content_part.done", **where, content_index=0, part=output_text(item.text))
        elif item.kind == "reasoning":
            self.event("response.reasoning_text.done", **where, content_index=0, text=item.text)
        else:
            self.event("response.function_call_arguments.done", **where, name=item.name, arguments=item.text)
        self.event("response.output_item.done", output_index=index, item=item.body("completed"))
