//! A serving loop over a [`Generator`]: requests with their own prompt, token limit, stop id and
//! sampling arrive at any time, wait in a queue, are admitted into free sequence slots while the
//! others keep decoding (continuous batching), and stream their tokens through a callback as they
//! are sampled. With a paged cache ([`crate::inference::CacheLayout::Paged`]) memory follows the
//! tokens in flight.

use std::collections::VecDeque;

use crate::device::Context;
use crate::error::{Error, Result};
use crate::inference::Generator;
use crate::kernels::sampling::Sampling;

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

/// A request in a slot: its settings, and what it has generated.
struct Active {
    id: u64,
    request: Request,
    generated: usize,
}

/// Requests queued and in flight over one generator.
pub struct Server {
    generator: Generator,
    queue: VecDeque<(u64, Request)>,
    slots: Vec<Option<Active>>,
    next_id: u64,
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
        })
    }

    /// The generator (its caches, logits and binding counts).
    pub fn generator(&self) -> &Generator {
        &self.generator
    }

    /// Queues `request`; returns its id. Refused now rather than when admitted: an empty prompt,
    /// one that leaves no room in the capacity for a token, an id past the vocabulary, bad
    /// sampling settings.
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
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back((id, request));
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

    /// One round: admits queued requests into free slots (their prompts prefilled together while
    /// the others keep their caches), samples every request in flight its next token with its own settings
    /// (one GPU sampling pass for all), streams them to `on_token`, ends finished
    /// requests (freeing their slots and cache), and feeds the others one decoding step.
    pub fn step(&mut self, ctx: &Context, on_token: impl FnMut(Token)) -> Result<()> {
        crate::device::block_on("Server::step", self.step_async(ctx, on_token))
    }

    /// Async form of [`Server::step`] (what a browser must use).
    pub async fn step_async(
        &mut self,
        ctx: &Context,
        mut on_token: impl FnMut(Token),
    ) -> Result<()> {
        // Every request admitted this round shares the same prefill passes.
        let free = (0..self.slots.len()).filter(|&slot| self.slots[slot].is_none());
        let admitted: Vec<(usize, (u64, Request))> = free
            .zip(std::iter::from_fn(|| self.queue.pop_front()))
            .collect();
        let prompts: Vec<(usize, &[u32])> = admitted
            .iter()
            .map(|(slot, (_, request))| (*slot, request.prompt.as_slice()))
            .collect();
        if !prompts.is_empty() {
            if let Err(e) = self.generator.admit_all(ctx, &prompts) {
                // None is admitted (a prefill stopped part way, by a full pool, is undone): the
                // requests wait at the queue's head, in order.
                for (slot, queued) in admitted.into_iter().rev() {
                    self.generator.release(slot)?;
                    self.queue.push_front(queued);
                }
                return Err(e);
            }
        }
        for (slot, (id, request)) in admitted {
            self.slots[slot] = Some(Active {
                id,
                request,
                generated: 0,
            });
        }
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
        let chosen: Vec<Option<u32>> = self
            .slots
            .iter()
            .zip(&ids)
            .map(|(a, &id)| a.as_ref().map(|_| id))
            .collect();
        let capacity = self.generator.shape().capacity;
        let mut feed = vec![None; self.slots.len()];
        for slot in 0..self.slots.len() {
            let (Some(active), Some(token)) = (self.slots[slot].as_mut(), chosen[slot]) else {
                continue;
            };
            let index = active.generated;
            active.generated += 1;
            let len = self.generator.lens()[slot] as usize;
            let finished = if Some(token) == active.request.stop {
                Some(Finish::Stop)
            } else if active.generated >= active.request.max_new_tokens {
                Some(Finish::Length)
            } else if len >= capacity {
                Some(Finish::Capacity)
            } else {
                None
            };
            on_token(Token {
                request: active.id,
                id: token,
                index,
                finished,
            });
            match finished {
                Some(_) => {
                    self.slots[slot] = None;
                    self.generator.release(slot)?;
                }
                None => feed[slot] = Some(token),
            }
        }
        if feed.iter().any(Option::is_some) {
            self.generator.step(ctx, &feed)?;
        }
        Ok(())
    }

    /// Runs [`Server::step`] until every queued and in-flight request has finished.
    pub fn run(&mut self, ctx: &Context, on_token: impl FnMut(Token)) -> Result<()> {
        crate::device::block_on("Server::run", self.run_async(ctx, on_token))
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
