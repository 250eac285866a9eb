//! A serving loop over a [`Generator`]: requests with their own prompt, token limit, stop id and
//! sampling arrive at any time, wait in a queue, are admitted into free sequence slots while the
//! others keep decoding (continuous batching), and stream their tokens through a callback as they
//! are sampled. With a paged cache ([`crate::CacheLayout::Paged`]) memory follows the
//! tokens in flight.
//!
//! Under memory pressure (a paged pool with too few free blocks) nothing is lost or repeated:
//! - a request that could never fit the pool alone is refused by [`Server::submit`]
//!   ([`Error::RequestTooLarge`]);
//! - queued requests are admitted in order while their prompts (and the next token) fit the free
//!   blocks left after the requests in flight take their next token; the rest wait;
//! - when the requests in flight outgrow the pool, the most recently admitted is **preempted**
//!   (vLLM's recompute policy): its cache is freed and it returns to the head of the queue with the
//!   tokens it has streamed, which are prefilled again after its prompt when it is readmitted, so
//!   its stream continues where it stopped (under greedy sampling with the same ids as without
//!   pressure);
//! - a token is streamed only once the decoding step that feeds it has succeeded: a step that
//!   fails streams nothing, and every request's count and cache stay as before it (a request
//!   preempted before the failure stays queued).

use std::collections::VecDeque;

use crate::Generator;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::sampling::Sampling;

/// One generation request.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The most tokens to generate.
    pub max_new_tokens: usize,
    /// Generation ends after this id (it is streamed).
    pub stop: Option<u32>,
    /// How its tokens are chosen.
    pub sampling: Sampling,
}

impl Request {
    /// Greedy generation of up to `max_new_tokens` after `prompt`, no stop id.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            max_new_tokens,
            stop: None,
            sampling: Sampling::greedy(),
        }
    }

    /// Ends after `id`.
    pub fn stop(mut self, id: u32) -> Self {
        self.stop = Some(id);
        self
    }

    /// Chooses tokens with `sampling`.
    pub fn sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finish {
    /// It generated its stop id.
    Stop,
    /// It generated `max_new_tokens`.
    Length,
    /// Its sequence filled the generator's capacity.
    Capacity,
}

/// A token streamed to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    /// The request's id (from [`Server::submit`]).
    pub request: u64,
    /// The token.
    pub id: u32,
    /// Its index among the request's generated tokens (0 for the first).
    pub index: usize,
    /// Set on the request's last token.
    pub finished: Option<Finish>,
}

/// A request in a slot, or waiting: its settings, and the tokens it has streamed.
struct Active {
    id: u64,
    request: Request,
    /// Streamed so far: after the prompt in the cache, and prefilled again after a preemption.
    generated: Vec<u32>,
    /// When it was (last) admitted: the most recent is preempted first.
    admitted: u64,
}

impl Active {
    /// The tokens its cache holds once admitted: the prompt, then what it has streamed.
    fn tokens(&self) -> Vec<u32> {
        [self.request.prompt.as_slice(), &self.generated].concat()
    }

    /// How many [`Active::tokens`] there are.
    fn len(&self) -> usize {
        self.request.prompt.len() + self.generated.len()
    }
}

/// Requests queued and in flight over one generator.
pub struct Server {
    generator: Generator,
    queue: VecDeque<Active>,
    slots: Vec<Option<Active>>,
    next_id: u64,
    admissions: u64,
}

impl Server {
    /// Serves with `generator` (decoder-only; its slots are the requests in flight at once). Every
    /// slot starts free.
    pub fn new(mut generator: Generator) -> Result<Self> {
        let slots = generator.shape().batch;
        for slot in 0..slots {
            generator.release(slot)?;
        }
        Ok(Self {
            generator,
            queue: VecDeque::new(),
            slots: (0..slots).map(|_| None).collect(),
            next_id: 0,
            admissions: 0,
        })
    }

    /// The generator (its caches, logits and binding counts).
    pub fn generator(&self) -> &Generator {
        &self.generator
    }

    /// Queues `request`; returns its id. Refused now rather than when admitted: an empty prompt,
    /// one that leaves no room in the capacity for a token, an id past the vocabulary, bad
    /// sampling settings, and with a paged cache a request whose prompt and new tokens need more
    /// blocks than the pool has ([`Error::RequestTooLarge`]).
    pub fn submit(&mut self, request: Request) -> Result<u64> {
        let capacity = self.generator.shape().capacity;
        if request.prompt.is_empty() || request.prompt.len() >= capacity {
            return Err(Error::shape(
                "prompt",
                format!(
                    "has {} tokens; it needs 1 to {} (the capacity {capacity} less one for a new token)",
                    request.prompt.len(),
                    capacity - 1
                ),
            ));
        }
        let vocab = self.generator.config().vocab;
        if let Some(&t) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::shape(
                "prompt",
                format!("id {t} is not below vocab {vocab}"),
            ));
        }
        if request.max_new_tokens == 0 {
            return Err(Error::shape(
                "max_new_tokens",
                "is 0; it must be at least 1",
            ));
        }
        request.sampling.check()?;
        if let Some(cache) = self.generator.paged_cache() {
            // At most the capacity; the last token is streamed, never fed, but the admission
            // keeps room for the next token too.
            let tokens = (request.prompt.len() + request.max_new_tokens).min(capacity);
            let (page, total) = (cache.config().page, cache.config().pool_blocks);
            let needed = tokens.div_ceil(page);
            if needed > total {
                return Err(Error::RequestTooLarge {
                    tokens,
                    needed,
                    page,
                    total,
                });
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back(Active {
            id,
            request,
            generated: Vec::new(),
            admitted: 0,
        });
        Ok(id)
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests in slots.
    pub fn in_flight(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Whether nothing is queued or in flight.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.in_flight() == 0
    }

    /// One round: admits queued requests into free slots while the pool has room (their prompts
    /// prefilled together while the others keep their caches), samples every request in flight
    /// its next token with its own settings (one GPU sampling pass for all), feeds the unfinished
    /// ones one decoding step (preempting the most recently admitted while the pool is short),
    /// then streams the tokens to `on_token` and ends finished requests (freeing their slots and
    /// cache). On error nothing is streamed (see the module's notes).
    pub fn step(&mut self, ctx: &Context, on_token: impl FnMut(Token)) -> Result<()> {
        wgpu_attention::device::block_on("Server::step", self.step_async(ctx, on_token))
    }

    /// Async form of [`Server::step`] (what a browser must use).
    pub async fn step_async(
        &mut self,
        ctx: &Context,
        mut on_token: impl FnMut(Token),
    ) -> Result<()> {
        self.admit(ctx)?;
        if self.in_flight() == 0 {
            return Ok(());
        }
        // Sample every slot in one pass, each with its request's settings (free slots greedy,
        // their draws unused).
        let settings: Vec<Sampling> = self
            .slots
            .iter()
            .map(|a| {
                a.as_ref()
                    .map_or(Sampling::greedy(), |a| a.request.sampling)
            })
            .collect();
        let ids = self.generator.sample_each_async(ctx, &settings).await?;
        let capacity = self.generator.shape().capacity;
        // Each request's token and whether it ends there; the others are fed.
        let mut chosen: Vec<Option<(u32, Option<Finish>)>> = vec![None; self.slots.len()];
        for (slot, active) in self.slots.iter().enumerate() {
            let Some(active) = active else { continue };
            let token = ids[slot];
            let len = self.generator.lens()[slot] as usize;
            let finished = if Some(token) == active.request.stop {
                Some(Finish::Stop)
            } else if active.generated.len() + 1 >= active.request.max_new_tokens {
                Some(Finish::Length)
            } else if len >= capacity {
                Some(Finish::Capacity)
            } else {
                None
            };
            chosen[slot] = Some((token, finished));
        }
        let mut feed: Vec<Option<u32>> = chosen
            .iter()
            .map(|c| c.and_then(|(token, finished)| finished.is_none().then_some(token)))
            .collect();
        while !self.step_fits(&feed)? {
            // The most recently admitted request being fed goes back to the queue's head; its
            // token is drawn again once it is readmitted.
            let victim = (0..self.slots.len())
                .filter(|&slot| feed[slot].is_some())
                .max_by_key(|&slot| self.slots[slot].as_ref().map_or(0, |a| a.admitted))
                .expect("a step that does not fit feeds some slot");
            let active = self.slots[victim].take().expect("fed slots are in flight");
            self.generator.release(victim)?;
            log::debug!(
                "wgpu-attention: server preempts request {} ({} tokens) for lack of cache blocks",
                active.id,
                active.len()
            );
            self.queue.push_front(active);
            feed[victim] = None;
            chosen[victim] = None;
        }
        if feed.iter().any(Option::is_some) {
            self.generator.step(ctx, &feed)?;
        }
        // The step has succeeded (or none was needed): stream, count, end the finished.
        for (slot, choice) in chosen.into_iter().enumerate() {
            let (Some((token, finished)), Some(active)) = (choice, self.slots[slot].as_mut())
            else {
                continue;
            };
            on_token(Token {
                request: active.id,
                id: token,
                index: active.generated.len(),
                finished,
            });
            active.generated.push(token);
            if finished.is_some() {
                self.slots[slot] = None;
                self.generator.release(slot)?;
            }
        }
        Ok(())
    }

    /// Admits queued requests, in order, into free slots while the paged pool (if any) has room
    /// for their prompts and next token once the requests in flight have taken their next one;
    /// those admitted share the prefill passes. On error none is admitted and the queue is as
    /// before.
    fn admit(&mut self, ctx: &Context) -> Result<()> {
        let mut room = self.free_blocks_after_next_step();
        let mut admitted: Vec<(usize, Active)> = Vec::new();
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() {
                continue;
            }
            let Some(next) = self.queue.front() else {
                break;
            };
            if let (Some(free), Some(page)) = (room, self.page()) {
                let needed = (next.len() + 1).div_ceil(page);
                if needed > free {
                    break;
                }
                room = Some(free - needed);
            }
            let mut active = self.queue.pop_front().expect("peeked");
            self.admissions += 1;
            active.admitted = self.admissions;
            admitted.push((slot, active));
        }
        if admitted.is_empty() {
            return Ok(());
        }
        let tokens: Vec<Vec<u32>> = admitted.iter().map(|(_, a)| a.tokens()).collect();
        let prompts: Vec<(usize, &[u32])> = admitted
            .iter()
            .zip(&tokens)
            .map(|((slot, _), t)| (*slot, t.as_slice()))
            .collect();
        if let Err(e) = self.generator.admit_all(ctx, &prompts) {
            // None is admitted (a prefill stopped part way is undone): the requests wait at the
            // queue's head, in order.
            for (slot, active) in admitted.into_iter().rev() {
                self.generator.release(slot)?;
                self.queue.push_front(active);
            }
            return Err(e);
        }
        for (slot, active) in admitted {
            self.slots[slot] = Some(active);
        }
        Ok(())
    }

    /// Tokens per block of a paged cache (`None`: contiguous, every slot's capacity reserved).
    fn page(&self) -> Option<usize> {
        self.generator.paged_cache().map(|c| c.config().page)
    }

    /// The paged pool's free blocks less those the requests in flight take for their next token
    /// (`None` for a contiguous cache).
    fn free_blocks_after_next_step(&self) -> Option<usize> {
        let cache = self.generator.paged_cache()?;
        let growing: usize = (0..self.slots.len())
            .filter(|&slot| self.slots[slot].is_some())
            .map(|slot| cache.blocks_to_grow(slot, 1))
            .sum();
        Some(cache.free_blocks().saturating_sub(growing))
    }

    /// Whether a step feeding `feed` has the blocks it needs (always, for a contiguous cache);
    /// any other reason the cache would refuse it is an error.
    fn step_fits(&self, feed: &[Option<u32>]) -> Result<bool> {
        let Some(cache) = self.generator.paged_cache() else {
            return Ok(true);
        };
        let new: Vec<u32> = feed.iter().map(|t| t.is_some() as u32).collect();
        match cache.check_room(&new) {
            Ok(_) => Ok(true),
            Err(Error::KvCacheFull { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Runs [`Server::step`] until every queued and in-flight request has finished.
    pub fn run(&mut self, ctx: &Context, on_token: impl FnMut(Token)) -> Result<()> {
        wgpu_attention::device::block_on("Server::run", self.run_async(ctx, on_token))
    }

    /// Async form of [`Server::run`].
    pub async fn run_async(
        &mut self,
        ctx: &Context,
        mut on_token: impl FnMut(Token),
    ) -> Result<()> {
        while !self.is_idle() {
            self.step_async(ctx, &mut on_token).await?;
        }
        Ok(())
    }
}
