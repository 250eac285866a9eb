//! The autotuner's state on a context ([`TuningMode`]): the choice made for each tuning key, the
//! cache file that keeps choices between runs, and the report of what was timed. The kernels that
//! tune (`kernels::attention::tune`) say what a key is and which candidates it has; this module
//! times them ([`Search`]), keeps the fastest for the context's life and persists it.

use super::tuning::KernelChoice;
use super::Context;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How a context picks the configuration of a kernel call where its options leave it open
/// ([`ContextOptions::tuning`](super::ContextOptions::tuning)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TuningMode {
    /// The static choice: measured defaults by adapter class and problem shape. Nothing is timed,
    /// no file is read.
    #[default]
    Off,
    /// Choices from the cache file ([`ContextOptions::tuning_cache`](super::ContextOptions::tuning_cache));
    /// keys it lacks run the static choice. Nothing is timed.
    CacheOnly,
    /// At the first call of a key the cache lacks, time the candidates on a problem of the call's
    /// shape (the call blocks meanwhile), keep the fastest, and add it to the cache file.
    Tune,
}

impl TuningMode {
    /// Parses `off`, `cache` or `tune` (as `WGPU_ATTENTION_TUNING` and the benches' `--tuning`).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_lowercase().as_str() {
            "off" => Ok(Self::Off),
            "cache" => Ok(Self::CacheOnly),
            "tune" => Ok(Self::Tune),
            other => Err(Error::shape(
                "tuning mode",
                format!("'{other}' is not one: use off, cache or tune"),
            )),
        }
    }

    /// The mode's name, as `parse` reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::CacheOnly => "cache",
            Self::Tune => "tune",
        }
    }
}

/// How long tuning may take ([`ContextOptions::tuning_budget`](super::ContextOptions::tuning_budget)):
/// each key stops timing further candidates once `per_key` has passed (pipeline compilation
/// included; the fastest so far wins), and once a context has spent `total`, later keys run the
/// static choice untimed. Defaults: 10 s per key, 120 s in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TuningBudget {
    /// Longest time one key's candidates are timed for.
    pub per_key: Duration,
    /// Longest time a context spends tuning in all.
    pub total: Duration,
}

impl Default for TuningBudget {
    fn default() -> Self {
        Self {
            per_key: Duration::from_secs(10),
            total: Duration::from_secs(120),
        }
    }
}

impl TuningBudget {
    /// A budget of `per_key` per key and `total` in all.
    pub fn new(per_key: Duration, total: Duration) -> Self {
        Self { per_key, total }
    }
}

/// One candidate of a tuning key, as [`Context::tuning_report`] lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CandidateRecord {
    /// The configuration.
    pub choice: KernelChoice,
    /// Seconds per call, the best of the timed runs; `None` where it was not timed.
    pub seconds: Option<f64>,
    /// `winner`, `slower by 1.31x`, or why it was not timed (`failed qualification: ...`,
    /// `refused: ...`, `skipped: ...`).
    pub verdict: String,
}

/// Where a key's choice came from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TuningSource {
    /// Timed on this context.
    Tuned,
    /// Read from the cache file.
    Cache,
    /// The static choice, and why (`not in the cache`, `the tuning budget is spent`, a failure).
    Static(String),
}

/// What the autotuner chose for one key ([`Context::tuning_report`]).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TuningRecord {
    /// The tuning key: kernel, head dims, length classes, rows of the grid, dtype and the masks
    /// that change the work, e.g. `attention_forward d64x64 q1024 k1024 bh8 f32 causal`.
    pub key: String,
    /// What the key's calls run for the rest of the context's life.
    pub chosen: KernelChoice,
    /// Where the choice came from.
    pub source: TuningSource,
    /// The candidates, in the order they were tried (the cache's where it came from there).
    pub candidates: Vec<CandidateRecord>,
    /// Seconds this context spent tuning the key (0 from the cache).
    pub seconds: f64,
}

impl fmt::Display for TuningRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            TuningSource::Tuned => format!("tuned in {:.2} s", self.seconds),
            TuningSource::Cache => "from the cache".to_string(),
            TuningSource::Static(why) => format!("static: {why}"),
        };
        write!(f, "{}: {} ({source})", self.key, self.chosen)?;
        for c in &self.candidates {
            let time = c
                .seconds
                .map_or("-".to_string(), |s| format!("{:.4} ms", s * 1e3));
            write!(
                f,
                "\n  {:<36} {time:>12}  {}",
                c.choice.to_string(),
                c.verdict
            )?;
        }
        Ok(())
    }
}

/// What a cache section is valid for: results of one library version on one adapter, driver and
/// set of limits that change which candidates exist.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Identity {
    library: String,
    adapter: String,
    vendor: u32,
    device: u32,
    backend: String,
    driver: String,
    driver_info: String,
    workgroup_storage: u32,
    trusted_shaders: bool,
    subgroups: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct CacheEntry {
    choice: KernelChoice,
    candidates: Vec<CandidateRecord>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    format: String,
    sections: Vec<CacheSection>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CacheSection {
    identity: Identity,
    entries: BTreeMap<String, CacheEntry>,
}

const CACHE_FORMAT: &str = "wgpu-attention tuning cache 1";

#[derive(Default)]
struct TunerState {
    /// Each key's choice, fixed once made.
    chosen: HashMap<String, KernelChoice>,
    /// The cache file's entries for this context's identity.
    cached: BTreeMap<String, CacheEntry>,
    report: Vec<TuningRecord>,
    spent: Duration,
}

/// The autotuner of one context.
pub(crate) struct Tuner {
    mode: TuningMode,
    path: Option<PathBuf>,
    budget: TuningBudget,
    /// [`ContextOptions::tune_tensor_cores`](super::ContextOptions::tune_tensor_cores).
    tensor_cores: bool,
    identity: Identity,
    /// Whether the cache file was read (at the first mode that uses it).
    cache_read: bool,
    state: Mutex<TunerState>,
    /// One key tuned at a time: a second thread with the same key waits, then reads the choice.
    tuning: Mutex<()>,
    /// The thread running candidates: its passes take no ordered writes and no profiler slot.
    tuning_thread: Mutex<Option<ThreadId>>,
}

impl Tuner {
    pub(crate) fn new(
        options: &super::ContextOptions,
        device: &wgpu::Device,
        trusted_shaders: bool,
        subgroups: bool,
    ) -> Self {
        let info = device.adapter_info();
        let identity = Identity {
            library: format!("{} {}", env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION")),
            adapter: info.name,
            vendor: info.vendor,
            device: info.device,
            backend: format!("{:?}", info.backend),
            driver: info.driver,
            driver_info: info.driver_info,
            workgroup_storage: device.limits().max_compute_workgroup_storage_size,
            trusted_shaders,
            subgroups,
        };
        let mut mode = options.tuning;
        if cfg!(target_arch = "wasm32") && mode == TuningMode::Tune {
            log::warn!(
                "wgpu-attention: tuning needs blocking waits and a clock, which the browser build \
                 has not; using the static choice"
            );
            mode = TuningMode::Off;
        }
        let mut tuner = Self {
            mode: TuningMode::Off,
            path: options.tuning_cache.clone(),
            budget: options.tuning_budget,
            tensor_cores: options.tune_tensor_cores,
            identity,
            cache_read: false,
            state: Mutex::new(TunerState::default()),
            tuning: Mutex::new(()),
            tuning_thread: Mutex::new(None),
        };
        tuner.set_mode(mode);
        tuner
    }

    /// Sets the mode, reading the cache file the first time a mode uses it.
    fn set_mode(&mut self, mode: TuningMode) {
        self.mode = mode;
        if mode == TuningMode::Off || self.cache_read {
            return;
        }
        self.cache_read = true;
        let (Some(path), identity) = (&self.path, &self.identity) else {
            return;
        };
        let Some(file) = read_cache(path) else { return };
        match file.sections.into_iter().find(|s| s.identity == *identity) {
            Some(section) => self.state().cached = section.entries,
            None => log::info!(
                "wgpu-attention: the tuning cache {} has no results for {} {} ({} {}, library \
                 {}); tuning anew",
                path.display(),
                identity.adapter,
                identity.backend,
                identity.driver,
                identity.driver_info,
                identity.library
            ),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TunerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes this context's entries into the cache file, keeping other identities' sections.
    fn save(&self, entries: BTreeMap<String, CacheEntry>) {
        let Some(path) = &self.path else { return };
        let mut file = read_cache(path).unwrap_or_default();
        file.format = CACHE_FORMAT.to_string();
        file.sections.retain(|s| s.identity != self.identity);
        file.sections.push(CacheSection {
            identity: self.identity.clone(),
            entries,
        });
        let written = serde_json::to_string_pretty(&file)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                // Written beside it and renamed: a reader never sees half a file.
                let partial = path.with_extension("partial");
                std::fs::write(&partial, text)
                    .and_then(|_| std::fs::rename(&partial, path))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            log::warn!(
                "wgpu-attention: could not write the tuning cache {}: {e}",
                path.display()
            );
        }
    }
}

/// The cache file at `path`: `None` (with a warning) where it is unreadable, not JSON or of
/// another format; `None` silently where it does not exist yet.
fn read_cache(path: &Path) -> Option<CacheFile> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!(
                "wgpu-attention: ignoring the tuning cache {}: {e}",
                path.display()
            );
            return None;
        }
    };
    match serde_json::from_str::<CacheFile>(&text) {
        Ok(file) if file.format == CACHE_FORMAT => Some(file),
        Ok(file) => {
            log::warn!(
                "wgpu-attention: ignoring the tuning cache {}: its format is '{}', not '{CACHE_FORMAT}'",
                path.display(),
                file.format
            );
            None
        }
        Err(e) => {
            log::warn!(
                "wgpu-attention: ignoring the tuning cache {}: {e} (it is replaced at the next save)",
                path.display()
            );
            None
        }
    }
}

/// The timed candidate with the fewest seconds per call, and its time.
fn fastest(candidates: &[CandidateRecord]) -> Option<(f64, KernelChoice)> {
    candidates
        .iter()
        .filter_map(|c| c.seconds.map(|s| (s, c.choice)))
        .min_by(|a, b| a.0.total_cmp(&b.0))
}

/// The candidates of one key being timed: kernels add each with [`Search::measure`].
pub(crate) struct Search<'a> {
    ctx: &'a Context,
    deadline: Instant,
    candidates: Vec<CandidateRecord>,
}

/// Each timed submission runs the candidate enough times to take about this long, so that the
/// submission's own cost does not decide between fast kernels.
const TIMED_SUBMISSION: Duration = Duration::from_millis(4);
/// Timed submissions per candidate; the best counts.
const TIMED_ROUNDS: usize = 3;
/// Back-to-back submissions of a candidate after its compile, before it is judged or timed: the GPU
/// idles while a pipeline compiles and drops its clocks, and a few milliseconds of timed rounds do
/// not bring them back (on an H200 a 0.94 ms backward timed 3.19 ms after its compile).
const WARM_UP: Duration = Duration::from_millis(25);
/// A candidate whose first timed call takes this many times the fastest so far is not timed
/// further: it cannot win, and on a slow device its rounds would spend the key's budget.
const HOPELESS: f64 = 2.0;

impl Search<'_> {
    /// Whether the key's budget is spent.
    pub(crate) fn out_of_time(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Whether `choice` was tried already.
    pub(crate) fn tried(&self, choice: &KernelChoice) -> bool {
        self.candidates.iter().any(|c| c.choice == *choice)
    }

    /// The fastest candidate timed so far.
    pub(crate) fn best(&self) -> Option<KernelChoice> {
        fastest(&self.candidates).map(|(_, choice)| choice)
    }

    /// Times `choice` unless tried already: `check` first (a small problem against the static
    /// choice: `Some(why)` refuses it), then `record` (one call of the candidate into an encoder)
    /// once to compile, then back to back for [`WARM_UP`], then repeated in submissions of about
    /// [`TIMED_SUBMISSION`], the best of [`TIMED_ROUNDS`] counting; a call that takes longer than
    /// the warm-up (the GPU busy since the compile) gets no warm-up and one timed round, which
    /// keeps the long keys' tuning within a few calls per candidate (an H200 spent 7-11 s on each
    /// L 16384 backward key with six calls per candidate). Errors of the candidate are
    /// its verdict, not the caller's; a device error is returned.
    pub(crate) fn measure(
        &mut self,
        choice: KernelChoice,
        check: impl FnOnce() -> Result<Option<String>>,
        mut record: impl FnMut(&mut wgpu::CommandEncoder) -> Result<()>,
    ) -> Result<()> {
        if self.tried(&choice) {
            return Ok(());
        }
        let verdict = |text: String| CandidateRecord {
            choice,
            seconds: None,
            verdict: text,
        };
        // The first candidate (the static choice) is timed whatever the budget: the baseline.
        if self.out_of_time() && !self.candidates.is_empty() {
            self.candidates
                .push(verdict("skipped: the key's tuning budget is spent".into()));
            return Ok(());
        }
        match check() {
            Ok(None) => {}
            Ok(Some(why)) => {
                self.candidates
                    .push(verdict(format!("failed qualification: {why}")));
                return Ok(());
            }
            Err(e) => {
                self.ctx.check_lost()?;
                self.candidates
                    .push(verdict(format!("failed qualification: {e}")));
                return Ok(());
            }
        }
        let ctx = self.ctx;
        let mut run = |times: usize| -> Result<Duration> {
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            for _ in 0..times {
                record(&mut encoder)?;
            }
            let start = Instant::now();
            ctx.submit(encoder)?;
            ctx.synchronize()?;
            Ok(start.elapsed())
        };
        // Compiles the pipelines; the next run says how many calls fill a timed submission.
        let once = run(1).and_then(|_| run(1));
        let once = match once {
            Ok(once) => once,
            Err(e) => {
                ctx.check_lost()?;
                self.candidates.push(verdict(format!("refused: {e}")));
                return Ok(());
            }
        };
        let calls = |estimate: Duration| {
            (TIMED_SUBMISSION.as_secs_f64() / estimate.as_secs_f64().max(1e-6))
                .ceil()
                .clamp(1.0, 64.0) as usize
        };
        // A call as long as the warm-up has kept the GPU busy since the compile (two such calls
        // ran back to back): it needs none, and one timed round.
        let long = once >= WARM_UP;
        let warm_up = Instant::now();
        let mut once = once;
        while !long && warm_up.elapsed() < WARM_UP && !self.out_of_time() {
            let times = calls(once);
            once = run(times)? / times as u32;
        }
        let fastest = fastest(&self.candidates).map_or(f64::INFINITY, |(s, _)| s);
        if once.as_secs_f64() > HOPELESS * fastest {
            self.candidates.push(CandidateRecord {
                choice,
                seconds: Some(once.as_secs_f64()),
                verdict: String::new(),
            });
            return Ok(());
        }
        let times = calls(once);
        let mut best = once.as_secs_f64();
        let rounds = if long { 1 } else { TIMED_ROUNDS };
        for _ in 0..rounds {
            if self.out_of_time() {
                break;
            }
            best = best.min(run(times)?.as_secs_f64() / times as f64);
        }
        self.candidates.push(CandidateRecord {
            choice,
            seconds: Some(best),
            verdict: String::new(),
        });
        Ok(())
    }
}

impl Context {
    /// How this context picks kernel configurations ([`TuningMode`]).
    pub fn tuning_mode(&self) -> TuningMode {
        self.tuner.mode
    }

    /// Changes the tuning mode (to compare tuned and static choices on one context). Choices
    /// made before stay as they are; a mode that uses the cache reads it the first time.
    pub fn set_tuning_mode(&mut self, mode: TuningMode) {
        if cfg!(target_arch = "wasm32") && mode == TuningMode::Tune {
            log::warn!("wgpu-attention: tuning is not available in the browser build");
            return;
        }
        self.tuner.set_mode(mode);
    }

    /// Whether tuning may pick the tensor-core family
    /// ([`ContextOptions::tune_tensor_cores`](super::ContextOptions::tune_tensor_cores)).
    pub fn tunes_tensor_cores(&self) -> bool {
        self.tuner.tensor_cores
    }

    /// Lets tuning pick the tensor-core family or not, for keys not tuned yet (keys tuned with it
    /// are cached apart from those tuned without).
    pub fn set_tune_tensor_cores(&mut self, allowed: bool) {
        self.tuner.tensor_cores = allowed;
    }

    /// What the autotuner chose for each key so far, in the order the keys came, with every
    /// candidate's time and verdict (empty with [`TuningMode::Off`]).
    pub fn tuning_report(&self) -> Vec<TuningRecord> {
        self.tuner.state().report.clone()
    }

    /// Whether this thread is timing tuning candidates (its passes belong to no caller).
    pub(crate) fn is_tuning_thread(&self) -> bool {
        // The mode changes only through `&mut self`, so no search runs while it is off: every
        // pass of an untuned context skips the lock.
        if self.tuner.mode == TuningMode::Off {
            return false;
        }
        let thread = self
            .tuner
            .tuning_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *thread == Some(std::thread::current().id())
    }

    /// The choice this context made for `key` so far, without tuning or reading the cache.
    pub(crate) fn tuned_choice_made(&self, key: &str) -> Option<KernelChoice> {
        self.tuner.state().chosen.get(key).copied()
    }

    /// The tuned choice for `key`, or `None` for the static choice: the one this context made
    /// before, else the cache's, else (with [`TuningMode::Tune`], within the budget) the fastest
    /// candidate `search` times. Made once per key and context: later calls get the same.
    pub(crate) fn tuned_choice(
        &self,
        key: &str,
        search: impl FnOnce(&mut Search<'_>) -> Result<()>,
    ) -> Result<Option<KernelChoice>> {
        let tuner = &self.tuner;
        if tuner.mode == TuningMode::Off {
            return Ok(None);
        }
        let settle = |state: &mut TunerState, choice, source, candidates, seconds| {
            state.chosen.insert(key.to_string(), choice);
            state.report.push(TuningRecord {
                key: key.to_string(),
                chosen: choice,
                source,
                candidates,
                seconds,
            });
            choice
        };
        {
            let mut state = tuner.state();
            if let Some(choice) = state.chosen.get(key) {
                return Ok(Some(*choice));
            }
            if let Some(entry) = state.cached.get(key).cloned() {
                let choice = settle(
                    &mut state,
                    entry.choice,
                    TuningSource::Cache,
                    entry.candidates,
                    0.0,
                );
                return Ok(Some(choice));
            }
            if tuner.mode == TuningMode::CacheOnly {
                let why = TuningSource::Static("not in the cache".into());
                return Ok(Some(settle(
                    &mut state,
                    KernelChoice::default(),
                    why,
                    vec![],
                    0.0,
                )));
            }
        }
        let _one_at_a_time = tuner.tuning.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(choice) = tuner.state().chosen.get(key) {
            return Ok(Some(*choice));
        }
        let spent = tuner.state().spent;
        if spent >= tuner.budget.total {
            let why = format!(
                "the context's tuning budget of {:.0} s is spent",
                tuner.budget.total.as_secs_f64()
            );
            let choice = KernelChoice::default();
            return Ok(Some(settle(
                &mut tuner.state(),
                choice,
                TuningSource::Static(why),
                vec![],
                0.0,
            )));
        }
        let start = Instant::now();
        let per_key = tuner.budget.per_key.min(tuner.budget.total - spent);
        let mut timing = Search {
            ctx: self,
            deadline: start + per_key,
            candidates: Vec::new(),
        };
        *tuner
            .tuning_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current().id());
        let searched = search(&mut timing);
        *tuner
            .tuning_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        let elapsed = start.elapsed();
        let mut candidates = timing.candidates;
        let best = fastest(&candidates);
        for c in &mut candidates {
            if let (Some(s), Some((fastest, _))) = (c.seconds, best) {
                c.verdict = match s == fastest {
                    true => "winner".to_string(),
                    false => format!("slower by {:.2}x", s / fastest),
                };
            }
        }
        let mut state = tuner.state();
        state.spent += elapsed;
        let (choice, source) = match (&searched, best) {
            (Err(e), _) => {
                log::warn!("wgpu-attention: tuning {key} failed, using the static choice: {e}");
                self.check_lost()?;
                (
                    KernelChoice::default(),
                    TuningSource::Static(format!("tuning failed: {e}")),
                )
            }
            (Ok(()), None) => (
                KernelChoice::default(),
                TuningSource::Static("no candidate could be timed".into()),
            ),
            (Ok(()), Some((_, choice))) => (choice, TuningSource::Tuned),
        };
        if source == TuningSource::Tuned {
            state.cached.insert(
                key.to_string(),
                CacheEntry {
                    choice,
                    candidates: candidates.clone(),
                },
            );
            let entries = state.cached.clone();
            log::info!("wgpu-attention: tuned {key}: {choice}");
            tuner.save(entries);
        }
        let choice = settle(
            &mut state,
            choice,
            source,
            candidates,
            elapsed.as_secs_f64(),
        );
        Ok(Some(choice))
    }
}
