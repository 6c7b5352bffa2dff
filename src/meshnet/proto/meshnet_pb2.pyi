from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("sha256", "architecture", "n_layer")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    architecture: str
    n_layer: int
    def __init__(self, sha256: _Optional[str] = ..., architecture: _Optional[str] = ..., n_layer: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n", "has_seed", "seed", "n_top_logprobs", "logit_bias", "grammar", "skip_logprob")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    SKIP_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_last_n: int
    has_seed: bool
    seed: int
    n_top_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar: Grammar
    skip_logprob: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., n_top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., skip_logprob: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "start")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    start: int
    def __init__(self, json_schema: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("major", "minor", "session_id", "epoch", "position", "step_id", "decode", "token_ids", "sampling", "dtype", "shape", "byte_order", "crc32", "total_bytes", "chunk_index", "n_chunks", "payload", "reserve_tokens", "next_hops", "failure", "verify", "rollback", "mtp_drafts", "layers", "routed_node_id", "reused_before")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_ORDER_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    N_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOPS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REUSED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    session_id: str
    epoch: int
    position: int
    step_id: int
    decode: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_order: str
    crc32: int
    total_bytes: int
    chunk_index: int
    n_chunks: int
    payload: bytes
    reserve_tokens: int
    next_hops: _containers.RepeatedCompositeFieldContainer[ForwardHop]
    failure: HopFailure
    verify: bool
    rollback: bool
    mtp_drafts: int
    layers: LayerRange
    routed_node_id: str
    reused_before: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., position: _Optional[int] = ..., step_id: _Optional[int] = ..., decode: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., byte_order: _Optional[str] = ..., crc32: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_index: _Optional[int] = ..., n_chunks: _Optional[int] = ..., payload: _Optional[bytes] = ..., reserve_tokens: _Optional[int] = ..., next_hops: _Optional[_Iterable[_Union[ForwardHop, _Mapping]]] = ..., failure: _Optional[_Union[HopFailure, _Mapping]] = ..., verify: _Optional[bool] = ..., rollback: _Optional[bool] = ..., mtp_drafts: _Optional[int] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., routed_node_id: _Optional[str] = ..., reused_before: _Optional[int] = ...) -> None: ...

class ForwardHop(_message.Message):
    __slots__ = ("node_id", "data_address", "layers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_address: str
    layers: LayerRange
    def __init__(self, node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class HopFailure(_message.Message):
    __slots__ = ("node_id", "code", "message", "retry_after_s", "unreachable")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    code: str
    message: str
    retry_after_s: float
    unreachable: bool
    def __init__(self, node_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., unreachable: _Optional[bool] = ...) -> None: ...

class AwaitStep(_message.Message):
    __slots__ = ("session_id", "step_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("n_past", "has_token", "token_id", "logprob", "top", "hidden", "failure", "tokens", "drafts", "reused")
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    n_past: int
    has_token: bool
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    hidden: Envelope
    failure: HopFailure
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    reused: int
    def __init__(self, n_past: _Optional[int] = ..., has_token: _Optional[bool] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., hidden: _Optional[_Union[Envelope, _Mapping]] = ..., failure: _Optional[_Union[HopFailure, _Mapping]] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., drafts: _Optional[_Iterable[int]] = ..., reused: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("node_id", "model", "layers", "engine", "backend", "n_embd", "n_vocab", "n_ctx", "is_head", "is_tail", "fixture", "max_sessions", "protocol_major", "protocol_minor", "residual_dims", "needs_token_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    FIXTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_DIMS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: ModelIdentity
    layers: LayerRange
    engine: str
    backend: str
    n_embd: int
    n_vocab: int
    n_ctx: int
    is_head: bool
    is_tail: bool
    fixture: bool
    max_sessions: int
    protocol_major: int
    protocol_minor: int
    residual_dims: _containers.RepeatedScalarFieldContainer[int]
    needs_token_ids: bool
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., engine: _Optional[str] = ..., backend: _Optional[str] = ..., n_embd: _Optional[int] = ..., n_vocab: _Optional[int] = ..., n_ctx: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., fixture: _Optional[bool] = ..., max_sessions: _Optional[int] = ..., protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., residual_dims: _Optional[_Iterable[int]] = ..., needs_token_ids: _Optional[bool] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("healthy", "active_sessions", "draining", "message", "instance", "unreachable_next_hops")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_NEXT_HOPS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    active_sessions: int
    draining: bool
    message: str
    instance: str
    unreachable_next_hops: _containers.RepeatedCompositeFieldContainer[ForwardHop]
    def __init__(self, healthy: _Optional[bool] = ..., active_sessions: _Optional[int] = ..., draining: _Optional[bool] = ..., message: _Optional[str] = ..., instance: _Optional[str] = ..., unreachable_next_hops: _Optional[_Iterable[_Union[ForwardHop, _Mapping]]] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("prefill_tokens", "decode_tokens", "prefill_seconds", "decode_seconds", "active_sessions", "kv_bytes", "weight_bytes", "errors", "kv_tokens_held", "kv_tokens_reserved", "kv_tokens_capacity", "iterations", "batch_rows", "max_batch_rows", "waiting_steps", "queue_seconds", "queued_steps", "kv_tokens_kept")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAITING_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_KEPT_FIELD_NUMBER: _ClassVar[int]
    prefill_tokens: int
    decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    active_sessions: int
    kv_bytes: int
    weight_bytes: int
    errors: _containers.ScalarMap[str, int]
    kv_tokens_held: int
    kv_tokens_reserved: int
    kv_tokens_capacity: int
    iterations: int
    batch_rows: int
    max_batch_rows: int
    waiting_steps: int
    queue_seconds: float
    queued_steps: int
    kv_tokens_kept: int
    def __init__(self, prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., active_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., errors: _Optional[_Mapping[str, int]] = ..., kv_tokens_held: _Optional[int] = ..., kv_tokens_reserved: _Optional[int] = ..., kv_tokens_capacity: _Optional[int] = ..., iterations: _Optional[int] = ..., batch_rows: _Optional[int] = ..., max_batch_rows: _Optional[int] = ..., waiting_steps: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., queued_steps: _Optional[int] = ..., kv_tokens_kept: _Optional[int] = ...) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("model_id", "names")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "offset", "total_bytes", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    total_bytes: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("name", "description", "type", "memory_total_bytes", "index", "cpu_features")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CPU_FEATURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    type: str
    memory_total_bytes: int
    index: int
    cpu_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., type: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., index: _Optional[int] = ..., cpu_features: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "model", "layers", "engine", "backend", "protocol_major", "protocol_minor", "free_memory_bytes", "decode_tokens_per_s", "max_sessions", "data_address", "relayed", "device", "version", "instance", "n_ctx", "numerics", "public_key", "signature", "timestamp")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    model: ModelIdentity
    layers: LayerRange
    engine: str
    backend: str
    protocol_major: int
    protocol_minor: int
    free_memory_bytes: int
    decode_tokens_per_s: float
    max_sessions: int
    data_address: str
    relayed: bool
    device: DeviceInfo
    version: str
    instance: str
    n_ctx: int
    numerics: str
    public_key: bytes
    signature: bytes
    timestamp: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., engine: _Optional[str] = ..., backend: _Optional[str] = ..., protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., decode_tokens_per_s: _Optional[float] = ..., max_sessions: _Optional[int] = ..., data_address: _Optional[str] = ..., relayed: _Optional[bool] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., version: _Optional[str] = ..., instance: _Optional[str] = ..., n_ctx: _Optional[int] = ..., numerics: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., timestamp: _Optional[float] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_s", "ttl_s", "open_to_all")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    OPEN_TO_ALL_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    ttl_s: float
    open_to_all: bool
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., open_to_all: _Optional[bool] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("node_id", "public_key", "signature", "timestamp")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    public_key: bytes
    signature: bytes
    timestamp: float
    def __init__(self, node_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., timestamp: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "active_sessions", "decode_tokens_per_s", "public_key", "signature", "timestamp")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    active_sessions: int
    decode_tokens_per_s: float
    public_key: bytes
    signature: bytes
    timestamp: float
    def __init__(self, node_id: _Optional[str] = ..., active_sessions: _Optional[int] = ..., decode_tokens_per_s: _Optional[float] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., timestamp: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model_sha256", "exclude_node_ids", "previous_epoch", "min_n_ctx", "prefer_like", "opens_session")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIN_N_CTX_FIELD_NUMBER: _ClassVar[int]
    PREFER_LIKE_FIELD_NUMBER: _ClassVar[int]
    OPENS_SESSION_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    exclude_node_ids: _containers.RepeatedScalarFieldContainer[str]
    previous_epoch: int
    min_n_ctx: int
    prefer_like: _containers.RepeatedCompositeFieldContainer[Hop]
    opens_session: bool
    def __init__(self, model_sha256: _Optional[str] = ..., exclude_node_ids: _Optional[_Iterable[str]] = ..., previous_epoch: _Optional[int] = ..., min_n_ctx: _Optional[int] = ..., prefer_like: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., opens_session: _Optional[bool] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("node_id", "address", "layers", "data_address", "relayed", "instance", "numerics")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    layers: LayerRange
    data_address: str
    relayed: bool
    instance: str
    numerics: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., data_address: _Optional[str] = ..., relayed: _Optional[bool] = ..., instance: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("epoch", "model", "hops")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    model: ModelIdentity
    hops: _containers.RepeatedCompositeFieldContainer[Hop]
    def __init__(self, epoch: _Optional[int] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., hops: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("info", "active_sessions", "last_heartbeat_age_s", "signed")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    active_sessions: int
    last_heartbeat_age_s: float
    signed: bool
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ..., active_sessions: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., signed: _Optional[bool] = ...) -> None: ...

class ModelManifest(_message.Message):
    __slots__ = ("model_id", "manifest")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    manifest: bytes
    def __init__(self, model_id: _Optional[str] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WorkItem(_message.Message):
    __slots__ = ("session_id", "position", "n_tokens", "decode", "layers", "model_sha256")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    n_tokens: int
    decode: bool
    layers: LayerRange
    model_sha256: str
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., n_tokens: _Optional[int] = ..., decode: _Optional[bool] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., model_sha256: _Optional[str] = ...) -> None: ...

class WorkReport(_message.Message):
    __slots__ = ("node_id", "items", "public_key", "signature", "timestamp")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    items: _containers.RepeatedCompositeFieldContainer[WorkItem]
    public_key: bytes
    signature: bytes
    timestamp: float
    def __init__(self, node_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[WorkItem, _Mapping]]] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., timestamp: _Optional[float] = ...) -> None: ...

class WorkReportReply(_message.Message):
    __slots__ = ("known", "recorded", "duplicates")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    known: bool
    recorded: int
    duplicates: int
    def __init__(self, known: _Optional[bool] = ..., recorded: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class DeliveredToken(_message.Message):
    __slots__ = ("session_id", "position")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class DeliveryReport(_message.Message):
    __slots__ = ("client_id", "tokens", "model_sha256")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[DeliveredToken]
    model_sha256: str
    def __init__(self, client_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[DeliveredToken, _Mapping]]] = ..., model_sha256: _Optional[str] = ...) -> None: ...

class DeliveryReportReply(_message.Message):
    __slots__ = ("recorded", "duplicates")
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    duplicates: int
    def __init__(self, recorded: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class NodeBalance(_message.Message):
    __slots__ = ("node_id", "model_sha256", "n_layer", "prefill_token_layers", "decode_token_layers", "tokens", "steps", "uncredited_steps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    UNCREDITED_STEPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model_sha256: str
    n_layer: int
    prefill_token_layers: int
    decode_token_layers: int
    tokens: float
    steps: int
    uncredited_steps: int
    def __init__(self, node_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., n_layer: _Optional[int] = ..., prefill_token_layers: _Optional[int] = ..., decode_token_layers: _Optional[int] = ..., tokens: _Optional[float] = ..., steps: _Optional[int] = ..., uncredited_steps: _Optional[int] = ...) -> None: ...

class ClientBalance(_message.Message):
    __slots__ = ("client_id", "delivered_tokens", "sessions")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    delivered_tokens: int
    sessions: int
    def __init__(self, client_id: _Optional[str] = ..., delivered_tokens: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class LedgerReply(_message.Message):
    __slots__ = ("nodes", "clients")
    NODES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeBalance]
    clients: _containers.RepeatedCompositeFieldContainer[ClientBalance]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeBalance, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientBalance, _Mapping]]] = ...) -> None: ...

class SessionActivity(_message.Message):
    __slots__ = ("session_id", "epoch", "hops", "tokens", "age_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    hops: _containers.RepeatedCompositeFieldContainer[Hop]
    tokens: int
    age_s: float
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., hops: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., tokens: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ActivityReport(_message.Message):
    __slots__ = ("client_id", "model_sha256", "sessions", "generated_tokens", "ttft_s", "version")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    model_sha256: str
    sessions: _containers.RepeatedCompositeFieldContainer[SessionActivity]
    generated_tokens: int
    ttft_s: _containers.RepeatedScalarFieldContainer[float]
    version: str
    def __init__(self, client_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[SessionActivity, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., ttft_s: _Optional[_Iterable[float]] = ..., version: _Optional[str] = ...) -> None: ...

class RelayDown(_message.Message):
    __slots__ = ("call_id", "kind", "frames", "session_id", "epoch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ATTACHED: _ClassVar[RelayDown.Kind]
        STEP: _ClassVar[RelayDown.Kind]
        CANCEL: _ClassVar[RelayDown.Kind]
        RELEASE: _ClassVar[RelayDown.Kind]
        HEALTH: _ClassVar[RelayDown.Kind]
        CAPABILITIES: _ClassVar[RelayDown.Kind]
    ATTACHED: RelayDown.Kind
    STEP: RelayDown.Kind
    CANCEL: RelayDown.Kind
    RELEASE: RelayDown.Kind
    HEALTH: RelayDown.Kind
    CAPABILITIES: RelayDown.Kind
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    kind: RelayDown.Kind
    frames: _containers.RepeatedCompositeFieldContainer[Envelope]
    session_id: str
    epoch: int
    def __init__(self, call_id: _Optional[int] = ..., kind: _Optional[_Union[RelayDown.Kind, str]] = ..., frames: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RelayUp(_message.Message):
    __slots__ = ("hello", "call_id", "code", "message", "has_retry_after", "retry_after_s", "replies", "health", "capabilities")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HAS_RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    hello: NodeRef
    call_id: int
    code: str
    message: str
    has_retry_after: bool
    retry_after_s: float
    replies: _containers.RepeatedCompositeFieldContainer[StepReply]
    health: HealthReply
    capabilities: Capabilities
    def __init__(self, hello: _Optional[_Union[NodeRef, _Mapping]] = ..., call_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., has_retry_after: _Optional[bool] = ..., retry_after_s: _Optional[float] = ..., replies: _Optional[_Iterable[_Union[StepReply, _Mapping]]] = ..., health: _Optional[_Union[HealthReply, _Mapping]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class RelayControlRequest(_message.Message):
    __slots__ = ("node_id", "kind", "session_id", "epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: RelayDown.Kind
    session_id: str
    epoch: int
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[RelayDown.Kind, str]] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RelayControlReply(_message.Message):
    __slots__ = ("health", "capabilities")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    health: HealthReply
    capabilities: Capabilities
    def __init__(self, health: _Optional[_Union[HealthReply, _Mapping]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...
