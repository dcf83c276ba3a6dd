"""How the prefill side turns pinned blocks into a chunk on the wire (`KVSender`'s part that
the publishing thread also runs): the chunk's index, destination blocks and header, and the
record that it awaits an acknowledgement."""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.llm_engine import LLMEngine
from tandem.kv_transfer._sender_records import Outgoing, Pinned, full_header
from tandem.kv_transfer.chunk_publisher import Prepared
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter, pages_checksum


class ChunkMaker:
    def __init__(
        self,
        engine: LLMEngine,
        layout: KVLayout,
        *,
        checksums: bool,
        awaiting_ack: Callable[[Outgoing], None],
    ) -> None:
        self.engine = engine
        self.headers = PagesHeaderWriter(layout)
        self.checksums = checksums
        self.awaiting_ack = awaiting_ack  # the sender's: stamps when the receiver was told
        self.block_size = engine.config.block_size
        self._block_bytes = engine.kv_pool.bytes_per_block
        self.num_chunks = 0
        self.num_bytes = 0  # page bytes handed to the transport

    def make(self, pinned: Pinned) -> Prepared:
        """A chunk of pinned blocks (on the thread that sends it; the publishing thread's under
        its lock): its peer, header and blocks; recorded as awaiting acknowledgement."""
        out, first, blocks, last = pinned
        grant = out.grant
        assert grant is not None, "streams only once the reservation is known"
        index = out.next_chunk
        out.next_chunk += 1
        offset = first - grant.num_hit_blocks
        dst = grant.dst_block_ids[offset : offset + len(blocks)]
        end_tokens = (first + len(blocks)) * self.block_size
        num_tokens = min(end_tokens, out.request.num_prompt_tokens) if last else end_tokens
        out.unacked[index] = blocks  # (a failed send releases them with the request)
        self.awaiting_ack(out)
        self.num_chunks += 1
        self.num_bytes += len(blocks) * self._block_bytes
        rid = out.request.request_id
        if not last and not self.checksums:
            return (
                grant.address,
                self.headers.plain_chunk(rid, index, num_tokens, blocks, dst),
                blocks,
            )
        checksum = (
            pages_checksum(self.engine.kv_pool.export_blocks(blocks))
            if self.checksums and blocks
            else None
        )
        header = full_header(
            self.headers,
            out,
            index,
            num_tokens,
            blocks,
            dst,
            last=last,
            checksum=checksum,
            tokenizer=self.engine.tokenizer,
        )
        return grant.address, header, blocks
