"""The segment object format (the object format): one chunk's KV as one content-addressed object.

    b"KVC1" | u32 header_len (LE) | header (msgpack map) | payload

The object key is a content digest, so identical content always lands on the same key and a
flipped bit anywhere is caught (digests.py). Format version 3 (written now) is addressed by
the BLAKE3-256 of its prefix and header, and the header holds a table of BLAKE3-256 digests
of the payload's pieces: one per layer for a raw, unencrypted payload (a layer is a contiguous
``[2, tokens, heads, dim]`` slice of it), one for the whole payload otherwise. The key covers
the table and the table covers every payload byte, so the key still pins every byte, and a
reader can check the header as soon as it has arrived and each layer as soon as its bytes have:
layer l is verified and usable while layer l + 1 is still in flight (stream.py). Version 2
(read, and written on request) is addressed by the BLAKE3-256 of the whole object, version 1
(read only) by its SHA-256. Decoding treats its input as hostile: every declared length is
checked against the real size and against the namespace before anything is allocated, and
every failure is a CorruptObjectError subclass (header.py).

Encrypted segments (``enc.alg = "aes-256-gcm"``, see crypto.py) carry ciphertext ‖ tag as
their payload: the codec's output is encrypted (compress first, then encrypt), the object key
is still the digest of the stored bytes, and decoding needs the tenant's key. The digest is
checked before the tag, so damage in transit or at rest reads as a digest mismatch, and a
tampered object re-stored under its own correct address reads as a DecryptionError.

The modules, one job each: ``header`` (prefix, header fields and their checks), ``digests``
(content addresses), ``codecs`` (payload compression and quantization), ``encode``,
``decode`` (an object in memory) and ``stream`` (an object read from a stream into place).
This package's names below are the format's public face: import them from ``kvcloud.segment``.
"""

from .codecs import CODECS, LOSSY_CODECS
from .decode import DecodedSegment, decode_segment
from .digests import (
    DIGEST_HEX_LEN,
    content_digest,
    digest_alg,
    digest_from_key,
    digest_matches,
    object_key,
)
from .encode import (
    EncodedSegment,
    SegmentParts,
    encode_segment,
    encode_segment_parts,
    encoded_size,
)
from .header import (
    DIGEST_ALGS,
    MAGIC,
    MAX_HEADER_LEN,
    MAX_RAW_LEN,
    MAX_UNBOUND_RAW_LEN,
    PIECE_DIGEST_BYTES,
    SEGMENT_VERSION,
    SegmentHeader,
    check_header,
    part_layout,
    part_record_fp,
    piece_bounds,
    read_header,
)
from .stream import Reader, read_segment_into

__all__ = [
    "CODECS",
    "DIGEST_ALGS",
    "DIGEST_HEX_LEN",
    "LOSSY_CODECS",
    "MAGIC",
    "MAX_HEADER_LEN",
    "MAX_RAW_LEN",
    "MAX_UNBOUND_RAW_LEN",
    "PIECE_DIGEST_BYTES",
    "SEGMENT_VERSION",
    "DecodedSegment",
    "EncodedSegment",
    "Reader",
    "SegmentHeader",
    "SegmentParts",
    "check_header",
    "content_digest",
    "decode_segment",
    "digest_alg",
    "digest_from_key",
    "digest_matches",
    "encode_segment",
    "encode_segment_parts",
    "encoded_size",
    "object_key",
    "part_layout",
    "part_record_fp",
    "piece_bounds",
    "read_header",
    "read_segment_into",
]
