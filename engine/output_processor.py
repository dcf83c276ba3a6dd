"""After sampling: append tokens, decide stops, detokenize, and emit `StepOutput`s.

Stop rules, in order, for each new token: a stop token id (or EOS unless `ignore_eos`) once
`min_tokens` are out; a stop string in the text, ending after the text of the first
`min_tokens` tokens, as vLLM searches (the text is cut just before it, also when it spans
several tokens); `max_tokens`; the model's context length. Streamed text holds back the
last `len(longest stop) - 1` characters so that a stop string is never half-emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.outputs import StepOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import NO_TOKEN


class OutputProcessor:
    def __init__(self, max_model_len: int, eos_token_id: int | None = None) -> None:
        """`eos_token_id`: the tokenizer's own end of sequence, the one stop token a request
        names no `stop_reason` for (as vLLM: the model's other end tokens, from its
        generation_config.json, and `stop_token_ids` are named)."""
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def process(self, requests: Sequence[Request], tokens: Sequence[int]) -> list[StepOutput]:
        outputs = []
        for req, token in zip(requests, tokens, strict=True):
            if token == NO_TOKEN:  # its constraints allow no token: it ends with what it has
                req.finish_reason = "stop"
                delta = self.text_delta(req, finished=True)
                outputs.append(StepOutput(req.request_id, [], delta, True, "stop"))
                continue
            req.token_ids.append(token)
            if req.status != RequestStatus.DECODING:
                req.set_status(RequestStatus.DECODING)
            reason = self._check_stop(req, token)
            if reason is not None and self._stops_in_held_text(req):
                reason = "stop"
            delta = self.text_delta(req, finished=reason is not None)
            if reason is not None:
                req.finish_reason = reason
            outputs.append(StepOutput(req.request_id, [token], delta, reason is not None, reason))
        return outputs

    def _check_stop(self, req: Request, token: int) -> str | None:
        params = req.params
        num_out = req.num_output_tokens
        if num_out >= params.min_tokens and token in req.stop_ids:
            if token != self.eos_token_id or params.ignore_eos:
                req.stop_reason = token
            if params.include_stop_str_in_output and req.output_text is not None:
                req.output_text.add(token)  # (its text, as vLLM keeps a stop token's so)
            return "stop"
        if req.output_text is not None:
            req.output_text.add(token)
            # (searched from the token after the first `min_tokens`, as vLLM searches)
            if params.stop and self._find_stop_string(req, num_out > params.min_tokens):
                return "stop"
        if req.matcher is not None and req.matcher.is_terminated():  # the JSON is complete
            return "stop"
        limit = params.max_tokens  # (None: `add_request` made it the context's end)
        if (limit is not None and num_out >= limit) or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stops_in_held_text(self, req: Request) -> bool:
        """Whether a stop string is in the text a finishing request's detokenizer still held
        (an incomplete character, written as U+FFFD at the end): that text is searched too."""
        params = req.params
        if req.output_text is None or not params.stop or isinstance(req.stop_reason, str):
            return False
        req.output_text.flush()
        return self._find_stop_string(req, req.num_output_tokens > params.min_tokens)

    @staticmethod
    def _find_stop_string(req: Request, counting: bool) -> bool:
        assert req.output_text is not None and req.params.stop
        keep = req.params.include_stop_str_in_output
        stop = req.output_text.find_stop(req.params.stop, counting=counting, keep=keep)
        if stop is None:
            return False
        req.stop_reason = stop
        return True

    @staticmethod
    def text_delta(req: Request, *, finished: bool) -> str:
        """Text not streamed yet (holding back what could start a stop string)."""
        detok = req.output_text
        if detok is None:
            return ""
        cut = isinstance(req.stop_reason, str)
        keep = req.params.include_stop_str_in_output
        return detok.delta(req.params.stop, finished=finished, cut=cut, keep=keep)
