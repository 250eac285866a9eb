//! Typed errors. Every message names the argument, the offending value and the limit, so a user knows
//! what to change. Input is validated before anything is recorded or dispatched.

use thiserror::Error;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
#[non_exhaustive]
/// Everything a call can refuse or report. Each variant names the argument, the value and the
/// limit, so the caller knows what to change; `#[non_exhaustive]`.
pub enum Error {
    /// No adapter matched the requested back ends and name filter.
    #[error("no GPU adapter found (back ends {backends}, name filter {filter:?}); available: {available}. On a machine without a GPU install a CPU driver: apt-get install mesa-vulkan-drivers")]
    NoAdapter {
        /// The back ends searched.
        backends: String,
        /// The adapter-name filter, if any.
        filter: Option<String>,
        /// The adapters that were found.
        available: String,
    },
    /// `WGPU_BACKEND` or an explicit back-end name was not recognised.
    #[error("unknown back end {0:?}: use vulkan, gl, metal or dx12")]
    UnknownBackend(String),
    /// A blocking call in a browser, whose page thread must never block (natively these calls
    /// wait): the call's `_async` form is what a page uses.
    #[error("{call} would block the page's thread: in a browser call its async form (Context::new_async, to_vec_async, ...)")]
    WouldBlock {
        /// The blocking call, e.g. `GpuTensor::to_vec`.
        call: &'static str,
    },
    /// The adapter refused the device request.
    #[error("device request failed: {0}")]
    RequestDevice(#[from] wgpu::RequestDeviceError),
    /// A shape argument does not fit the operation.
    #[error("{arg}: {message}")]
    Shape {
        /// The argument.
        arg: &'static str,
        /// What is wrong with it, with the values.
        message: String,
    },
    /// A dimension is larger than this engine or the adapter supports.
    #[error("{arg} = {value} exceeds the supported maximum {limit}{hint}")]
    Unsupported {
        /// The argument or dimension.
        arg: &'static str,
        /// The value given.
        value: u64,
        /// The largest supported value.
        limit: u64,
        /// What to do instead (may be empty).
        hint: &'static str,
    },
    /// A buffer binding would exceed the adapter's `max_storage_buffer_binding_size`.
    #[error("{arg} needs a {bytes}-byte storage binding but the adapter allows at most {limit} bytes (max_storage_buffer_binding_size); reduce batch, heads or sequence length, or use the fused path")]
    BindingTooLarge {
        /// The argument bound.
        arg: &'static str,
        /// The binding's size.
        bytes: u64,
        /// The device's `max_storage_buffer_binding_size`.
        limit: u64,
    },
    /// The device reported an error (validation, internal) while running our commands.
    #[error("GPU error: {0}")]
    Device(String),
    /// The device refused an allocation: the GPU (or the host memory of a CPU driver) is full.
    #[error("out of GPU memory allocating {bytes} bytes for {what} ({allocated} bytes already allocated by this context); use a smaller batch or sequence length, drop tensors you no longer need, or choose a GPU with more memory")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// The refused allocation's size.
        bytes: u64,
        /// Bytes this context already held.
        allocated: u64,
    },
    /// The device was lost (driver reset, GPU removed, `Device::destroy`); nothing more can run on it.
    #[error("the GPU device was lost ({0}); its buffers are gone: create a new Context and reload weights from a checkpoint")]
    DeviceLost(String),
    /// A training step produced a non-finite loss or gradient norm. From that step on the optimizer
    /// changes nothing, so the parameters are those after the last good step.
    #[error("training step {step}: non-finite {what}; the optimizer skipped this step and every later one, so the parameters are those after step {last_good}. Resume from the last checkpoint with a lower learning rate, or enable gradient clipping")]
    NonFinite {
        /// The step whose loss or gradient norm was not finite.
        step: u32,
        /// The last step whose results were kept.
        last_good: u32,
        /// `loss` or `gradient norm`.
        what: &'static str,
    },
    /// A tensor's element type does not fit the operation.
    #[error("{arg} is {found}: {message}")]
    DType {
        /// The argument.
        arg: &'static str,
        /// Its element type.
        found: &'static str,
        /// Which types the operation takes.
        message: String,
    },
    /// The operation needs a device feature this device lacks.
    #[error("{what} needs the device feature {feature}, which {adapter} does not offer (or the device was created without it){hint}")]
    MissingFeature {
        /// The operation.
        what: &'static str,
        /// The wgpu feature it needs.
        feature: &'static str,
        /// The adapter's name.
        adapter: String,
        /// Where the alternative is (may be empty).
        hint: &'static str,
    },
    /// A tensor of another [`crate::Context`] was passed: its buffer lives on another device (or
    /// another context's memory account).
    #[error("{arg} was created by another Context; a tensor is usable only with the Context that allocated it (this one runs on {adapter}): create it with this context, or copy its values over")]
    ForeignTensor {
        /// The argument.
        arg: &'static str,
        /// The adapter of the context called.
        adapter: String,
    },
    /// Two arguments of one call share memory where wgpu or the kernel cannot allow it.
    #[error("{arg} shares memory with {other}: {rule}")]
    Aliasing {
        /// The argument refused.
        arg: &'static str,
        /// The argument it shares memory with.
        other: &'static str,
        /// The rule it breaks and what to do.
        rule: &'static str,
    },
    /// A checkpoint could not be written or does not fit the model.
    #[error("checkpoint {0}")]
    Checkpoint(String),
    /// Mapping a buffer for readback failed.
    #[error("buffer readback failed: {0}")]
    Readback(String),
    /// A paged key/value cache has too few free blocks for a step; nothing was changed.
    #[error("the paged KV cache needs {needed} free blocks for this step but has {free} of {total}; remove finished sequences, or build the cache with more blocks")]
    KvCacheFull {
        /// Blocks the step needs (new pages and copies of shared ones).
        needed: usize,
        /// Blocks free.
        free: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A request a serving loop could never hold: its prompt and new tokens need more blocks of a
    /// paged cache than the whole pool has. Refused at submission; nothing was queued.
    #[error("the request needs {needed} blocks of {page} tokens ({tokens} tokens: prompt and max_new_tokens) but the paged KV cache holds {total}; shorten it, or build the cache with more blocks")]
    RequestTooLarge {
        /// Tokens the request can hold in the cache at most.
        tokens: usize,
        /// Blocks they take.
        needed: usize,
        /// Tokens per block.
        page: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A Hugging Face model directory could not be read, or describes a model this engine would not
    /// compute exactly as `transformers` does (see `wgpu_attention_transformer::model::pretrained`).
    #[error("model {dir}: {problem}")]
    Pretrained {
        /// The model directory.
        dir: String,
        /// What is wrong.
        problem: PretrainedProblem,
    },
}

/// Why a Hugging Face model directory was refused ([`Error::Pretrained`]).
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum PretrainedProblem {
    /// A file is missing, unreadable or malformed.
    #[error("{file}: {message}")]
    File {
        /// The file, relative to the model directory.
        file: String,
        /// What went wrong.
        message: String,
    },
    /// `config.json`'s `model_type` is not one this engine maps.
    #[error("model_type {0:?} is not supported; supported: gpt2, llama")]
    UnknownArchitecture(String),
    /// A `config.json` option this engine does not implement (or not with this value): loading
    /// anyway would compute something other than what `transformers` computes.
    #[error("config.json option {option} = {value} is not supported: {reason}")]
    UnsupportedOption {
        /// The option's name.
        option: String,
        /// Its value, as JSON.
        value: String,
        /// What is supported instead.
        reason: String,
    },
    /// A tensor the model needs is in no weight file.
    #[error("tensor {0} is missing from the weight files")]
    MissingTensor(String),
    /// A weight file holds a tensor the model has no place for.
    #[error("tensor {0} is not part of this architecture's model; the checkpoint does not match config.json")]
    UnexpectedTensor(String),
    /// A tensor's shape differs from what `config.json` implies.
    #[error("tensor {name} has shape {found:?}; config.json implies {expected:?}")]
    TensorShape {
        /// The tensor.
        name: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the configuration needs.
        expected: Vec<usize>,
    },
    /// A tensor's element type is not f32, f16 or bf16.
    #[error("tensor {name} is {dtype}; weights must be F32, F16 or BF16")]
    TensorDtype {
        /// The tensor.
        name: String,
        /// Its element type.
        dtype: String,
    },
}

impl Error {
    /// An [`Error::Shape`] naming argument `arg` and what is wrong with its value: how the engine and
    /// the layers built on it refuse an argument.
    pub fn shape(arg: &'static str, message: impl Into<String>) -> Self {
        Error::Shape {
            arg,
            message: message.into(),
        }
    }
}
