"""Arrow schemas, validation, the Kafka wire codec (Arrow IPC) and the bounded JSON parser for control records."""

from ember.schemas.codec import (
    decode,
    decode_reward,
    decode_rollout,
    decode_train_batch,
    encode,
    encode_reward,
    encode_rollout,
    encode_train_batch,
)
from ember.schemas.documents import (
    CLUSTER_SCHEMA,
    DOCUMENT_SCHEMA,
    REJECTED_SCHEMA,
    Document,
    Rejected,
    content_hash,
    make_document_id,
)
from ember.schemas.errors import DecodeError, FieldIssue, SchemaValidationError
from ember.schemas.rollouts import (
    REWARD_SCHEMA,
    ROLLOUT_SCHEMA,
    TRAIN_BATCH_SCHEMA,
    Reward,
    Rollout,
    RolloutRef,
    SourceOffset,
    TrainBatch,
    Turn,
    routed_experts_dtype,
)
from ember.schemas.shards import PACKED_SEQUENCE_SCHEMA, Manifest, read_manifest, write_manifest
from ember.schemas.versioning import conform

__all__ = [
    "CLUSTER_SCHEMA",
    "DOCUMENT_SCHEMA",
    "PACKED_SEQUENCE_SCHEMA",
    "REJECTED_SCHEMA",
    "REWARD_SCHEMA",
    "ROLLOUT_SCHEMA",
    "TRAIN_BATCH_SCHEMA",
    "DecodeError",
    "Document",
    "FieldIssue",
    "Manifest",
    "Rejected",
    "Reward",
    "Rollout",
    "SchemaValidationError",
    "RolloutRef",
    "SourceOffset",
    "TrainBatch",
    "Turn",
    "conform",
    "content_hash",
    "decode",
    "decode_reward",
    "decode_rollout",
    "decode_train_batch",
    "encode",
    "encode_reward",
    "encode_rollout",
    "encode_train_batch",
    "make_document_id",
    "read_manifest",
    "routed_experts_dtype",
    "write_manifest",
]
