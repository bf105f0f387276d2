//! The root context's life: configure (or refuse) a configuration, hand each request its
//! journey, deliver store writes on wake-ups and ticks, and stay after a push retired the
//! configuration until the writes it holds are taken.

use std::cell::RefCell;
use std::rc::Rc;

use idempotency_protocol::stream::{CallOp, Reply};

use crate::config::Config;
use crate::host::Host;
use crate::journey::registry::Journeys;
use crate::journey::{Event, RequestJourney};
use crate::mail::Mail;
use crate::plugin::detached::{self, DetachedAnswer, DetachedCarry, PortableDetached};
use crate::plugin::resolutions::{give_up_portable, PortableResolution};
use crate::plugin::vm_roles::{Role, MARK_RENEWAL_MS};
use crate::plugin::waits::{read_wait_reply, WAIT_TICK_MS};
use crate::plugin::{Claims, Plugin};
use crate::store::client::{read_claim_reply, StoreClaim, StoreFailure};
use crate::store::link::{ClaimWaiter, Waiter};
use crate::store::writes::PendingWrite;

/// How often the root retries store writes that failed.
pub const STORE_RETRY_TICK_MS: u32 = 200;
/// With store streams: how often the root checks their deadlines and reopens them.
pub const STREAM_TICK_MS: u32 = 100;
/// The first tick after a configuration comes this soon: it opens the streams (a worker's
/// clusters may not exist yet while it is being configured).
pub const FIRST_TICK_MS: u32 = 10;
/// Without a store: how often the root looks after retired tables.
pub const UPKEEP_TICK_MS: u32 = 1_000;

#[derive(Default)]
pub struct PluginRoot {
    /// The host's id of this root context, which owns the store streams.
    context_id: u32,
    plugin: Option<Rc<Plugin>>,
    /// The tick runs at FIRST_TICK_MS until the streams were first opened.
    first_tick_pending: bool,
    /// Envoy is retiring this configuration (a push replaced it) but store writes still wait:
    /// the root stays until they are taken or their deadlines pass.
    finishing: bool,
    /// Retired tables are looked after once a second, however fast the tick runs.
    next_upkeep_ms: u64,
    /// This root's role under its vm_id, marked while it is configured (see `vm_roles`).
    role: Option<Role>,
    /// When the role's mark is next renewed.
    next_mark_ms: u64,
    /// The requests' journeys, by context id: where the root hands each what arrives for it.
    journeys: Rc<Journeys>,
    /// What the root's step has for requests, run in their contexts when the step is over
    /// (`apply_mail`), or, when the host runs a request only in its own hooks (`by_mail`),
    /// left for the host to deliver (`take_mail`).
    by_mail: bool,
    mail: RefCell<Vec<Mail>>,
}

impl PluginRoot {
    pub fn new(context_id: u32) -> PluginRoot {
        PluginRoot {
            context_id,
            ..PluginRoot::default()
        }
    }

    /// From now on events for requests are left as mail (see [`crate::mail`]).
    pub fn deliver_by_mail(&mut self) {
        self.by_mail = true;
    }

    /// The mail the root left since the last time, in the order it was left.
    pub fn take_mail(&self) -> Vec<Mail> {
        self.mail
            .try_borrow_mut()
            .map(|mut mail| std::mem::take(&mut *mail))
            .unwrap_or_default()
    }

    /// Runs `mail` on its request's journey, in that request's own hook; a request whose
    /// journey is gone (or busy) gets it as undelivered.
    pub fn deliver_mail(&self, host: &impl Host, mail: Mail) {
        let Some(journey) = self.journeys.find(mail.context_id) else {
            return self.undelivered(host, mail);
        };
        let Ok(mut journey) = journey.try_borrow_mut() else {
            return self.undelivered(host, mail);
        };
        let _ = journey.on(host, mail.event);
    }

    /// `mail`'s request cannot take it (it is gone, or was busy): a claim the store may
    /// hold for it is released, or the key would answer 409 everywhere until its lease ends.
    /// Anything else it carried held nothing.
    pub fn undelivered(&self, host: &impl Host, mail: Mail) {
        let (Some(plugin), Some(claim), Event::StoreReply { answer, .. }) =
            (&self.plugin, mail.claim, &mail.event)
        else {
            return;
        };
        orphaned(host, plugin, claim, answer);
    }

    /// False makes Envoy refuse the configuration.
    pub fn on_configure(&mut self, host: &impl Host) -> bool {
        self.configure_with(host, true, Claims::Made)
    }

    /// Checks the configuration as `on_configure` takes it (its metrics defined, a bad one
    /// refused and logged) without opening its store streams: for a host that checks it once
    /// where no stream can be opened, and builds the roots that serve it elsewhere (the
    /// native build, on Envoy's main thread).
    pub fn check_configuration(&mut self, host: &impl Host) -> bool {
        self.configure_with(host, false, Claims::Made)
    }

    /// Configures a root that makes no claims and resolves the unknown outcomes, and sends
    /// the detached writes, of `roots` others (their `resolve_elsewhere`,
    /// `send_detached_elsewhere`): its table layout is not registered, and its budgets are
    /// theirs together (bounded).
    pub fn on_configure_to_resolve_for(&mut self, host: &impl Host, roots: usize) -> bool {
        let configured = self.configure_with(host, true, Claims::None);
        if let Some(plugin) = &self.plugin {
            plugin.resolutions.resolve_for(roots);
            plugin.detached.send_for(roots);
        }
        configured
    }

    fn configure_with(&mut self, host: &impl Host, open_streams: bool, claims: Claims) -> bool {
        self.role = None;
        let configured = configure(host, claims).map(|(plugin, role)| {
            self.role = Some(role);
            self.next_mark_ms = host.now_ms().saturating_add(MARK_RENEWAL_MS);
            plugin
        });
        match configured {
            Ok(plugin) if plugin.config.grpc_replay_echo => {
                log::info!("configured as the gRPC replay echo: answers replays' hops only");
                plugin.root_context.set(self.context_id);
                self.plugin = Some(Rc::new(plugin));
                true
            }
            Ok(plugin) => {
                log::info!(
                    "configured {} rule(s); local table holds {} records in {} buckets",
                    plugin.rules.len(),
                    plugin.table.capacity(),
                    plugin.table.bucket_count()
                );
                plugin.root_context.set(self.context_id);
                self.first_tick_pending = !plugin.links.is_empty();
                // Opened now if the worker's clusters exist yet, else on the first tick.
                if open_streams {
                    self.open_streams(host, &plugin);
                    self.apply_mail(host);
                }
                self.plugin = Some(Rc::new(plugin));
                true
            }
            Err(message) => {
                log::error!("{message}");
                false
            }
        }
    }

    /// The configuration in force (tests look at its held duplicates).
    #[cfg(test)]
    pub(crate) fn plugin(&self) -> Option<&Plugin> {
        self.plugin.as_deref()
    }

    /// The journeys the root can find (tests look at how many it tracks).
    #[cfg(test)]
    pub(crate) fn journeys(&self) -> &Journeys {
        &self.journeys
    }

    /// A new request's journey; None before a configuration was accepted.
    pub fn new_request(&self, context_id: u32) -> Option<Rc<std::cell::RefCell<RequestJourney>>> {
        self.plugin
            .as_ref()
            .map(|p| RequestJourney::shared(Rc::clone(p), &self.journeys, context_id))
    }

    /// The resolutions this root's requests take on go to another root (see
    /// `take_resolutions`), which holds them where this one may not run: the native build's
    /// roots live on workers that run only while they have requests.
    pub fn resolve_elsewhere(&self) {
        if let Some(plugin) = &self.plugin {
            plugin.resolutions.resolve_elsewhere();
        }
    }

    /// Whether resolutions wait to be carried to the root that resolves for this one.
    pub fn has_resolutions_to_carry(&self) -> bool {
        self.plugin
            .as_ref()
            .is_some_and(|p| p.resolutions.has_outgoing())
    }

    /// The resolutions waiting to be carried to the root that resolves for this one.
    pub fn resolutions_to_carry(&self) -> Vec<PortableResolution> {
        self.plugin
            .as_ref()
            .map_or_else(Vec::new, |p| p.resolutions.take_outgoing())
    }

    /// The detached writes this root's requests make go to another root (see
    /// `take_detached`), which runs them where this one may not: the native build's roots live
    /// on workers that run only while they have requests, and a detached write must be
    /// recorded, and its lease renewed, when its client is gone.
    pub fn send_detached_elsewhere(&self) {
        if let Some(plugin) = &self.plugin {
            plugin.detached.send_elsewhere();
        }
    }

    /// Whether detached writes (or notices of their clients leaving) wait to be carried.
    pub fn has_detached_to_carry(&self) -> bool {
        self.plugin
            .as_ref()
            .is_some_and(|p| p.detached.has_outgoing())
    }

    pub fn detached_to_carry(&self) -> Vec<DetachedCarry> {
        self.plugin
            .as_ref()
            .map_or_else(Vec::new, |p| p.detached.take_outgoing())
    }

    /// Gives back what the host could not carry, for the next carry.
    pub fn keep_detached_to_carry(&self, refused: Vec<DetachedCarry>) {
        if let Some(plugin) = &self.plugin {
            for carry in refused {
                plugin.detached.carry(carry);
            }
        }
    }

    /// The request `context_id` of this root's, whose detached write another root ran, is
    /// answered by the host now; false when it waits for no such answer (any more).
    pub fn answered_elsewhere(&self, context_id: u32) -> bool {
        let Some(journey) = self.journeys.find(context_id) else {
            return false;
        };
        let Ok(mut journey) = journey.try_borrow_mut() else {
            return false;
        };
        journey.answered_elsewhere()
    }

    /// On the root that runs other roots' detached writes (same configuration): runs each as
    /// a journey of its own, under the context id the host gave it (which the host maps to
    /// the worker's request: its answer goes there), and sends it now.
    pub fn take_detached(&mut self, host: &impl Host, carried: Vec<(u32, PortableDetached)>) {
        let Some(plugin) = self.plugin.clone() else {
            log::error!(
                "{} detached write(s) not sent: the root that sends them has no configuration",
                carried.len()
            );
            return;
        };
        for (context_id, write) in carried {
            let Some(rule) = plugin.handle_of(&write.rule) else {
                // Never sent: its claim's lease lapses, and a retry runs it.
                log::error!(
                    "rule {}: a detached write not sent: this configuration has no such rule",
                    write.rule.name
                );
                continue;
            };
            let journey = RequestJourney::shared(Rc::clone(&plugin), &self.journeys, context_id);
            let here = host.set_effective_context(context_id).is_ok();
            match journey.try_borrow_mut() {
                Ok(mut journey) => {
                    if !here {
                        journey.context_is_gone();
                    }
                    journey.run_carried(host, rule, write);
                }
                Err(_) => log::error!("a carried detached write's journey was busy"),
            }
            if let Err(e) = host.set_effective_context(self.context_id) {
                log::error!("root context not restored: {}", e.0);
            }
        }
        // Their leases, in the store too, before the writes go out.
        plugin
            .leases
            .renew_due(host, &plugin.table, &plugin.writes, &plugin.links());
        self.send_detached(host, &plugin);
    }

    /// This root is going with its configuration, and Envoy cancels its callouts: a detached
    /// write it sent may have run, so it is an unknown outcome (never run again by a retry);
    /// one not sent yet ran nowhere, so its key is freed.
    pub fn give_up_detached(&mut self, host: &impl Host) {
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        let (queued, in_flight) = plugin.detached.take_all();
        for flight in in_flight {
            log::warn!(
                "rule {}: a detached write was running when its configuration went; its \
                 outcome is unknown",
                flight.rule.rule.name
            );
            let answer = detached::overdue_answer(host, &flight);
            self.in_request_even_if_gone(host, flight.context_id, Event::DetachedAnswer(answer));
        }
        for write in queued {
            let answer = DetachedAnswer::NotSent("its configuration went".into());
            self.in_request_even_if_gone(host, write.context_id, Event::DetachedAnswer(answer));
        }
    }

    /// The client of a carried detached write (`context_id`, as `take_detached` ran it) left,
    /// or Envoy answered it: its answer is only recorded.
    pub fn client_left(&self, host: &impl Host, context_id: u32) {
        let Some(journey) = self.journeys.find(context_id) else {
            return; // answered already
        };
        let Ok(mut journey) = journey.try_borrow_mut() else {
            return;
        };
        journey.context_is_gone();
        let _ = journey.on(host, Event::StreamEnd);
    }

    /// Whether this configuration has `rule` (a resolution of it can be taken on here).
    pub fn has_rule(&self, rule: &crate::config::Rule) -> bool {
        self.plugin
            .as_ref()
            .is_some_and(|p| p.handle_of(rule).is_some())
    }

    /// Gives back resolutions the host could not carry (see `Resolutions::keep_to_carry`).
    pub fn keep_to_carry(&self, host: &impl Host, refused: Vec<PortableResolution>) {
        if let Some(plugin) = &self.plugin {
            plugin
                .resolutions
                .keep_to_carry(host, &plugin.table, refused);
        }
    }

    /// Every resolution this root holds, as plain data, for a root of another
    /// configuration (see `Resolutions::surrender`).
    pub fn surrender_resolutions(&self) -> Vec<PortableResolution> {
        self.plugin
            .as_ref()
            .map_or_else(Vec::new, |p| p.resolutions.surrender())
    }

    /// On the root that resolves for others (same configuration): takes theirs on, each under
    /// this root's handle of its rule. An overdue key it resolves already is not asked about
    /// twice.
    pub fn take_resolutions(&mut self, host: &impl Host, carried: Vec<PortableResolution>) {
        let Some(plugin) = &self.plugin else {
            log::error!(
                "{} resolution(s) dropped: the root that resolves them has no configuration",
                carried.len()
            );
            return;
        };
        for portable in carried {
            let Some(rule) = plugin.handle_of(&portable.rule) else {
                give_up_portable(
                    host,
                    &plugin.table,
                    &portable,
                    "no rule of this configuration",
                );
                continue;
            };
            // Overdue retries on several workers each carry the same one.
            if portable.adopted && plugin.resolutions.resolving_outcome(&portable) {
                continue;
            }
            let (resolution, adopted) = portable.into_resolution(rule);
            plugin
                .resolutions
                .take_on(host, &plugin.table, resolution, adopted);
        }
        // What is due goes out now, not at the next tick: an overdue resolution taken on here
        // claims it in the store before other proxies' retries find it overdue too.
        plugin.resolutions.on_tick(host, &plugin.settlers());
    }

    /// A push retired this configuration. Completions and releases still waiting out a store
    /// outage live in this root, and so do the duplicates it holds (its tick answers them):
    /// keep it (its tick, callouts and streams go on) until the writes are taken or their
    /// deadlines pass and every held duplicate is answered, instead of losing them with it.
    /// True: done now.
    pub fn on_done(&mut self) -> bool {
        let Unfinished {
            writes,
            held,
            running,
            detached,
            resolving,
        } = self.unfinished();
        if writes == 0 && held == 0 && running == 0 && detached == 0 && resolving == 0 {
            return true;
        }
        log::warn!(
            "configuration retired with {writes} store write(s) still waiting, {held} \
             duplicate(s) held, {running} request(s) running upstream, {detached} \
             detached write(s) in flight and {resolving} unknown outcome(s) being resolved; \
             kept until the writes are taken or their deadlines pass, the duplicates are \
             answered, the requests end (their leases are renewed meanwhile) and the \
             resolutions settle or run out of attempts"
        );
        self.finishing = true;
        false
    }

    /// Whether the root holds work its ticks move on (store writes, held duplicates,
    /// requests running upstream, detached writes, resolutions): a host that ticks a root
    /// only on demand keeps ticking it while this holds.
    pub fn has_unfinished_work(&self) -> bool {
        self.unfinished() != Unfinished::default()
    }

    /// What a retired configuration's root stays for: store writes still waiting, duplicates
    /// still held (each answered within its `wait_ms`), and requests still running upstream,
    /// whose leases it renews.
    fn unfinished(&self) -> Unfinished {
        self.plugin
            .as_ref()
            .map_or(Unfinished::default(), |p| Unfinished {
                writes: p.writes.pending(),
                held: p.waits.held().0,
                running: p.leases.len(),
                detached: p.detached.len(),
                resolving: p.resolutions.len(),
            })
    }

    /// A detached write, or a store write the root sent, was answered.
    pub fn on_callout_answer(
        &mut self,
        host: &impl Host,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if let Some(plugin) = &self.plugin {
            if let Some(flight) = plugin.detached.take(token) {
                let answer = detached::read_answer(host, &flight, num_headers, body_size);
                self.in_request_even_if_gone(
                    host,
                    flight.context_id,
                    Event::DetachedAnswer(answer),
                );
            } else if plugin.resolutions.on_answer(
                host,
                &plugin.settlers(),
                token,
                num_headers,
                body_size,
            ) {
                // A lookup: settled, or asked again later.
            } else if !plugin
                .writes
                .on_answer(host, &plugin.table, token, num_headers, body_size)
            {
                log::debug!("answer for unknown store call {token} ignored");
            }
            // A resolution's settle may have been answered: it goes on from its answer.
            plugin
                .resolutions
                .on_store_answers(host, &plugin.settlers());
        }
        self.finish_if_idle(host);
    }

    /// Whether store writes wait to be sent (see `send_fresh_writes`).
    pub fn has_fresh_writes(&self) -> bool {
        self.plugin.as_ref().is_some_and(|p| p.writes.has_fresh())
    }

    /// Sends the store writes requests submitted, at once: what `on_queue_ready` does for a
    /// host whose root is not woken by its queue (the native build's).
    pub fn send_fresh_writes(&self, host: &impl Host) {
        if let Some(plugin) = &self.plugin {
            if let Some(queue) = plugin.writes.wake_queue() {
                self.on_queue_ready(host, queue);
            }
        }
    }

    /// A request queued a store write, or waits for a store stream to open.
    pub fn on_queue_ready(&self, host: &impl Host, queue_id: u32) {
        if let Some(plugin) = &self.plugin {
            if plugin.writes.is_wake_queue(queue_id) {
                self.open_streams(host, plugin);
                plugin.writes.on_wake(host, &plugin.links());
                plugin
                    .resolutions
                    .on_store_answers(host, &plugin.settlers());
                self.send_detached(host, plugin);
            }
        }
        self.apply_mail(host);
    }

    pub fn on_tick(&mut self, host: &impl Host) {
        if let Some(plugin) = &self.plugin {
            self.open_streams(host, plugin);
            for link in &plugin.links {
                let (sent, never_sent) = link.expire(host);
                for waiter in sent {
                    self.deliver(host, plugin, waiter, Err(StoreFailure::NoAnswer));
                }
                for waiter in never_sent {
                    self.deliver(host, plugin, waiter, Err(no_stream()));
                }
            }
            let is_live = |context_id| self.journeys.is_live(context_id);
            for (waiter, end) in plugin.waits.due(host, &plugin.table, is_live) {
                // A held duplicate whose request is gone holds nothing to undo.
                self.in_request(host, Mail::new(waiter.context_id, Event::WaitOver(end)));
            }
            plugin
                .leases
                .renew_due(host, &plugin.table, &plugin.writes, &plugin.links());
            plugin.writes.on_tick(host, &plugin.links());
            self.send_detached(host, plugin);
            plugin.resolutions.on_tick(host, &plugin.settlers());
            let now = host.now_ms();
            if let (Some(role), true) = (self.role, now >= self.next_mark_ms) {
                self.next_mark_ms = now.saturating_add(MARK_RENEWAL_MS);
                role.mark(host);
            }
            if now >= self.next_upkeep_ms {
                self.next_upkeep_ms = now.saturating_add(u64::from(UPKEEP_TICK_MS));
                plugin.upkeep.on_tick(host);
            }
            if self.first_tick_pending {
                self.first_tick_pending = false;
                let period = steady_tick_ms(plugin);
                if let Err(e) = host.set_tick_period_ms(period) {
                    log::warn!("tick period refused: {}", e.0);
                }
            }
        }
        self.apply_mail(host);
        self.finish_if_idle(host);
    }

    /// Opens the store streams that are due; claims that waited for one go out on it.
    fn open_streams(&self, host: &impl Host, plugin: &Plugin) {
        let writes_due = plugin.writes.due(host.now_ms());
        for link in &plugin.links {
            for waiter in link.open_if_due(host, writes_due) {
                self.deliver(host, plugin, waiter, Err(no_stream()));
            }
        }
    }

    /// A store stream opened: its metadata says how large a message the store takes.
    pub fn on_grpc_initial_metadata(&self, host: &impl Host, stream: u32) {
        if let Some(plugin) = &self.plugin {
            let _ours = plugin
                .links
                .iter()
                .any(|link| link.on_initial_metadata(host, stream));
        }
    }

    /// A message arrived on a store stream: hand the answer to whoever waits for it.
    pub fn on_grpc_message(&mut self, host: &impl Host, stream: u32, size: usize) {
        if let Some(plugin) = &self.plugin {
            let answered = plugin
                .links
                .iter()
                .find_map(|link| link.on_message(host, stream, size));
            if let Some((waiter, reply)) = answered {
                self.deliver(host, plugin, waiter, Ok(reply));
            }
            plugin
                .resolutions
                .on_store_answers(host, &plugin.settlers());
        }
        self.apply_mail(host);
        self.finish_if_idle(host);
    }

    /// A store stream closed: every call on it failed; the tick reopens it.
    pub fn on_grpc_close(&mut self, host: &impl Host, stream: u32, status: u32) {
        if let Some(plugin) = &self.plugin {
            let failed = plugin
                .links
                .iter()
                .find_map(|link| link.on_close(host, stream, status))
                .unwrap_or_default();
            for waiter in failed {
                self.deliver(host, plugin, waiter, Err(StoreFailure::NoAnswer));
            }
            plugin
                .resolutions
                .on_store_answers(host, &plugin.settlers());
        }
        self.apply_mail(host);
        self.finish_if_idle(host);
    }

    /// Hands a stream call's outcome to its waiter: the store writes, or a request, as mail
    /// its journey takes once the step is over (resume, replay, answer).
    fn deliver(
        &self,
        host: &impl Host,
        plugin: &Plugin,
        waiter: Waiter,
        answer: Result<Reply, StoreFailure>,
    ) {
        let claim = match waiter {
            Waiter::Write(write) => {
                match answer {
                    Ok(reply) => plugin
                        .writes
                        .on_stream_answer(host, &plugin.table, write, &reply),
                    Err(_) => plugin.writes.on_stream_failure(host, write),
                }
                return;
            }
            Waiter::Claim(claim) => claim,
        };
        if let CallOp::Lookup { .. } = claim.call {
            // A caller's lookup: it holds nothing, so a request gone needs no undoing.
            let event = Event::LookupAnswer {
                id: claim.call_id,
                found: crate::lookup_route::found_in_reply(answer),
            };
            self.in_request(host, Mail::new(claim.context_id, event));
            return;
        }
        if let CallOp::Wait { .. } = claim.call {
            // A held duplicate's wait: it holds nothing, so a request gone needs no undoing.
            let end = read_wait_reply(answer);
            self.in_request(host, Mail::new(claim.context_id, Event::WaitOver(end)));
            return;
        }
        let answer = answer.and_then(read_claim_reply);
        if answer.is_ok() {
            plugin.writes.store_answered();
        }
        let event = Event::StoreReply {
            id: claim.call_id,
            answer,
        };
        let context_id = claim.context_id;
        self.in_request(host, Mail::for_claim(context_id, event, claim));
    }

    /// Leaves `mail` for its request: the step that made it goes on, and the request takes
    /// it once the step is over (`apply_mail`, or the host's own delivery). A request gone
    /// gets it as undelivered now.
    fn in_request(&self, host: &impl Host, mail: Mail) {
        if self.journeys.find(mail.context_id).is_none() {
            return self.undelivered(host, mail);
        }
        match self.mail.try_borrow_mut() {
            Ok(mut queued) => queued.push(mail),
            Err(_) => self.undelivered(host, mail),
        }
    }

    /// The end of a root step, on a host that runs each request's event in that request's
    /// context from the root (proxy-wasm): each letter the step left runs on its journey in
    /// its request's context, then the root's context is the effective one again. A host
    /// that delivers by mail takes the letters itself (`take_mail`).
    fn apply_mail(&self, host: &impl Host) {
        if self.by_mail {
            return;
        }
        // A journey's step leaves no mail of its own; bounded all the same.
        for _ in 0..4 {
            let mail = self.take_mail();
            if mail.is_empty() {
                return;
            }
            for letter in mail {
                self.run_in_request(host, letter);
            }
        }
    }

    fn run_in_request(&self, host: &impl Host, mail: Mail) {
        if let Err(e) = host.set_effective_context(mail.context_id) {
            log::debug!("request gone before the root could answer it: {}", e.0);
            return self.undelivered(host, mail);
        }
        self.deliver_mail(host, mail);
        if let Err(e) = host.set_effective_context(self.context_id) {
            log::error!("root context not restored: {}", e.0);
        }
    }

    /// Sends the detached writes requests queued; one Envoy refuses is handed back to its
    /// request (nothing ran: its key is freed).
    fn send_detached(&self, host: &impl Host, plugin: &Plugin) {
        for flight in plugin.detached.take_overdue(host.now_ms()) {
            log::error!(
                "rule {}: Envoy never answered a detached write; its outcome is unknown",
                flight.rule.rule.name
            );
            let answer = detached::overdue_answer(host, &flight);
            self.in_request_even_if_gone(host, flight.context_id, Event::DetachedAnswer(answer));
        }
        for (write, why) in plugin.detached.send_queued(host) {
            let answer = DetachedAnswer::NotSent(why);
            self.in_request_even_if_gone(host, write.context_id, Event::DetachedAnswer(answer));
        }
    }

    /// Runs `event` on a journey the root keeps alive (a detached write's): in the request's
    /// context if it is still there, else in the root's, since its key must still be recorded
    /// or freed. The journey is kept no longer once it has the answer.
    fn in_request_even_if_gone(&self, host: &impl Host, context_id: u32, event: Event) {
        let Some(journey) = self.journeys.find(context_id) else {
            log::error!("a detached write's journey is gone; its answer is lost");
            return;
        };
        self.journeys.release(context_id);
        let Ok(mut journey) = journey.try_borrow_mut() else {
            log::error!("a detached write's journey was busy; its answer is lost");
            return;
        };
        let here = host.set_effective_context(context_id).is_ok();
        if !here {
            journey.context_is_gone();
        }
        journey.on(host, event);
        // Given back before the host acts on the root again: it may run the request's hooks
        // then (the reply the step sent), which take the journey.
        drop(journey);
        if here {
            if let Err(e) = host.set_effective_context(self.context_id) {
                log::error!("root context not restored: {}", e.0);
            }
        }
    }

    /// A finishing root whose writes are all taken tells Envoy it is done.
    fn finish_if_idle(&mut self, host: &impl Host) {
        if !self.finishing || self.unfinished() != Unfinished::default() {
            return;
        }
        self.finishing = false;
        match host.done() {
            Ok(()) => log::info!(
                "retired configuration: every waiting store write was taken, every held \
                 duplicate answered"
            ),
            Err(e) => log::warn!("retired configuration not released: {}", e.0),
        }
    }
}

/// See `PluginRoot::unfinished`.
#[derive(Debug, Default, PartialEq, Eq)]
struct Unfinished {
    writes: usize,
    held: usize,
    running: usize,
    detached: usize,
    resolving: usize,
}

/// The configuration and its role under its vm_id, checked before it touches shared data: an
/// echo refused for sharing the filter's vm_id must not lay out a table there first.
fn configure(host: &impl Host, claims: Claims) -> Result<(Plugin, Role), String> {
    let bytes = host
        .plugin_configuration()
        .map_err(|e| format!("plugin configuration unreadable: {}", e.0))?;
    let config = Config::parse(&bytes).map_err(|e| e.to_string())?;
    let role = if config.grpc_replay_echo {
        Role::ReplayEcho
    } else {
        Role::Filter
    };
    role.check(host)?;
    let plugin = Plugin::build_for(host, config, claims)?;
    role.mark(host);
    // The tick is always set: it opens store streams, retries store writes and empties
    // retired tables.
    let tick = if plugin.links.is_empty() {
        steady_tick_ms(&plugin)
    } else {
        FIRST_TICK_MS
    };
    host.set_tick_period_ms(tick)
        .map_err(|e| format!("tick period refused: {}", e.0))?;
    Ok((plugin, role))
}

/// A claim answered after its request was gone (without the stream end that would have
/// withdrawn it): a claim the store may hold is released, or the key would answer 409
/// everywhere until the lease ends.
fn orphaned(
    host: &impl Host,
    plugin: &Plugin,
    claim: ClaimWaiter,
    answer: &Result<StoreClaim, StoreFailure>,
) {
    let may_hold = match answer {
        Ok(StoreClaim::Claimed { .. }) => true,
        Ok(_) => false,
        Err(failure) => failure.may_have_been_applied(),
    };
    log::warn!(
        "rule {}: a store answer found its request gone; its local claim ends with its lease",
        claim.rule.rule.name
    );
    if let (true, CallOp::Claim { key, owner, .. }) = (may_hold, claim.call) {
        let deadline = host.now_ms().saturating_add(claim.rule.rule.lease_ms);
        let call = CallOp::Release { key, owner };
        let write = PendingWrite::new(Rc::clone(&claim.rule), call, deadline).best_effort();
        plugin.writes.submit(host, write);
    }
}

/// The tick once the streams (if any) are open: as often as the most demanding of its jobs
/// needs (held duplicates, store streams, store write retries, retired tables).
fn steady_tick_ms(plugin: &Plugin) -> u32 {
    let mut tick = UPKEEP_TICK_MS;
    if plugin.uses_store() {
        tick = tick.min(STORE_RETRY_TICK_MS);
    }
    if !plugin.links.is_empty() {
        tick = tick.min(STREAM_TICK_MS);
    }
    if plugin.holds_duplicates() {
        tick = tick.min(WAIT_TICK_MS);
    }
    // Live leases are renewed every third of a lease: the tick must come at least as often
    // as a quarter of the shortest.
    if let Some(lease_ms) = plugin.shortest_lease_ms() {
        let quarter = u32::try_from(lease_ms / 4)
            .unwrap_or(u32::MAX)
            .max(FIRST_TICK_MS);
        tick = tick.min(quarter);
    }
    tick
}

fn no_stream() -> StoreFailure {
    StoreFailure::NotSent("no stream to the store could carry the call".to_string())
}
