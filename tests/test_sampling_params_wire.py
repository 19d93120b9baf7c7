"""An `AddRequest`'s SamplingParams crosses the control plane as only the fields the request sets: every field
survives the trip (one set off its default each), and a field left at its default costs no bytes."""
import dataclasses

import msgspec
import numpy as np

from moe_runtime.attention_dp.messages import AddRequest, MessageCodec
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

EVERY_FIELD_SET = SamplingParams(
    max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop=["x"], stop_token_ids=[9], ignore_eos=True,
    logprobs=2, min_tokens=1, prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=-0.25,
    repetition_penalty=1.3, min_p=0.05, logit_bias={5: -100.0}, cache_salt="tenant",
    structured_output=StructuredOutputSpec(json_schema='{"type": "object"}'), return_routed_experts=True,
    forced_routed_experts=np.arange(12, dtype=np.uint8).reshape(2, 3, 2))


def _through_the_codec(params: SamplingParams, **fields) -> tuple[AddRequest, AddRequest, int]:
    """(sent, arrived, bytes on the wire)"""
    codec = MessageCodec()
    sent = AddRequest(request_id="r", prompt_token_ids=[1, 2], params=params, dp_rank=1, **fields)
    payload = codec.encode(sent)
    return sent, codec.decode_to_rank(payload), len(payload)


def test_every_field_off_its_default_arrives_as_it_was_sent():
    defaults = SamplingParams()
    unset = [f.name for f in dataclasses.fields(SamplingParams)
             if getattr(EVERY_FIELD_SET, f.name) == getattr(defaults, f.name)]
    assert unset == [], f"set these too, so the test covers every field: {unset}"
    sent, arrived_message, _ = _through_the_codec(EVERY_FIELD_SET, export_kv=True, resumed_token_ids=[3])
    assert arrived_message == sent   # the message's own fields too
    arrived = arrived_message.params
    assert arrived == EVERY_FIELD_SET
    assert isinstance(arrived.structured_output, StructuredOutputSpec)
    assert np.array_equal(arrived.forced_routed_experts.to_numpy(), EVERY_FIELD_SET.forced_routed_experts.to_numpy())


def test_a_field_at_its_default_costs_no_bytes():
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    sent, arrived, size = _through_the_codec(greedy)
    assert arrived == sent
    _, _, with_routing = _through_the_codec(dataclasses.replace(greedy, return_routed_experts=True))
    assert with_routing - size == len("return_routed_experts") + 2   # the key's string and one boolean byte
    field_by_field = len(msgspec.msgpack.encode(greedy))   # the dataclass as msgspec writes it: every field
    assert size < field_by_field / 2, f"{size} bytes for a two-token greedy request ({field_by_field} its params alone)"
