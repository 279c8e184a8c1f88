//! Who decides: one replica, elected through a Lease, decides every
//! admission that takes a key, from its own index and without an API write on the request's path; the
//! others forward those reviews to it. This is the election's state machine, after client-go's
//! `leaderelection`: pure, on the times it is handed (`crate::cluster::lead` reads and writes the
//! Lease; the simulation drives it with its own clock).
//!
//! Safety, as client-go argues it: a replica takes the Lease over only after it has seen the same
//! record unchanged for the whole lease duration (by its own clock, from when it first saw it); the
//! holder stops deciding `renew_deadline` after its last successful renewal started. Both measure
//! durations on their own clocks (no agreement of clocks needed), so the holder stopped at least
//! `lease − renew_deadline` before any successor starts: the gap in which the reviews the old holder
//! answered reach etcd and every replica's watches.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

/// The election's timings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terms {
    /// How long a record stands after its last renewal (`leaseDurationSeconds`).
    pub lease: Duration,
    /// The holder decides until this long after its last renewal started.
    pub renew_deadline: Duration,
    /// How often the Lease is read and renewed.
    pub retry: Duration,
}

impl Terms {
    /// The elector's timings from the lease duration, in client-go's proportions (15 s, 10 s, 2 s).
    pub fn of_lease(lease: Duration) -> Terms {
        Terms {
            lease,
            renew_deadline: lease.mul_f64(2.0 / 3.0),
            retry: lease.mul_f64(2.0 / 15.0),
        }
    }
}

/// What the Lease says, as far as the election reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// `spec.holderIdentity` (empty: released).
    pub holder: String,
    /// Where the holder takes forwarded reviews (`https://ip:port`).
    pub address: String,
    /// `spec.renewTime` (the holder's clock, for people: no decision reads it).
    pub renewed: Timestamp,
    /// `spec.leaseTransitions`.
    pub transitions: i32,
}

/// What the replica should do with the Lease now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write this record (over the one last read, or create it).
    Write(Record),
    /// Nothing: another replica holds it.
    Wait,
}

/// Where a review that takes a key is decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Here: this replica holds the Lease.
    Here,
    /// At the holder's address.
    Forward(String),
    /// Nowhere for now: no replica holds a valid Lease (an election in progress).
    Nobody,
}

/// One replica's side of the election.
#[derive(Clone, Debug)]
pub struct Elector {
    me: String,
    address: String,
    terms: Terms,
    /// The record last read, and when this replica first saw it as it is.
    observed: Option<(Record, Timestamp)>,
    /// When this replica's last successful write of the Lease started.
    renewed: Option<Timestamp>,
    /// How many times this replica took the Lease (from another holder, or from nobody).
    term: u64,
}

fn after(t: Timestamp, d: Duration) -> Timestamp {
    t.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX))
        .unwrap_or(Timestamp::MAX)
}

impl Elector {
    /// The elector of replica `me`, which takes forwarded reviews at `address`.
    pub fn new(me: impl Into<String>, address: impl Into<String>, terms: Terms) -> Elector {
        Elector {
            me: me.into(),
            address: address.into(),
            terms,
            observed: None,
            renewed: None,
            term: 0,
        }
    }

    /// This replica's name.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The timings.
    pub fn terms(&self) -> Terms {
        self.terms
    }

    /// The Lease as read at `now` (`None`: there is none).
    pub fn observe(&mut self, record: Option<Record>, now: Timestamp) {
        match (record, &self.observed) {
            (Some(r), Some((seen, _))) if *seen == r => {}
            (Some(r), _) => self.observed = Some((r, now)),
            (None, _) => self.observed = None,
        }
    }

    fn expired(&self, now: Timestamp) -> bool {
        match &self.observed {
            None => true,
            Some((r, _)) if r.holder.is_empty() => true,
            Some((_, seen)) => now >= after(*seen, self.terms.lease),
        }
    }

    /// What to do at `now`: renew a Lease this replica holds, take over one whose holder has not renewed
    /// it for the lease duration (or that nobody holds), else wait.
    pub fn step(&self, now: Timestamp) -> Step {
        // A record in this replica's name that this incarnation never wrote (it restarted) is waited
        // out like anyone's: the reviews its predecessor answered last may not be in the caches yet.
        let mine = self.renewed.is_some()
            && self
                .observed
                .as_ref()
                .is_some_and(|(r, _)| r.holder == self.me);
        if !mine && !self.expired(now) {
            return Step::Wait;
        }
        let transitions = match &self.observed {
            Some((r, _)) if r.holder == self.me => r.transitions,
            Some((r, _)) => r.transitions.saturating_add(1),
            None => 0,
        };
        Step::Write(Record {
            holder: self.me.clone(),
            address: self.address.clone(),
            renewed: now,
            transitions,
        })
    }

    /// The write of `record`, started at `started`, went through.
    pub fn written(&mut self, record: Record, started: Timestamp) {
        if !self.deciding(started) {
            self.term += 1;
        }
        self.observed = Some((record, started));
        self.renewed = Some(started);
    }

    /// Whether this replica decides at `now`: it holds the Lease and its last renewal started less
    /// than the renew deadline ago.
    pub fn deciding(&self, now: Timestamp) -> bool {
        let holds = self
            .observed
            .as_ref()
            .is_some_and(|(r, _)| r.holder == self.me);
        holds
            && self
                .renewed
                .is_some_and(|at| now < after(at, self.terms.renew_deadline))
    }

    /// How many times this replica took the Lease: a new term starts each time it begins deciding
    /// after not deciding (also after its own renewals lapsed: another may have decided meanwhile).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Where a review that takes a key goes at `now`.
    pub fn route(&self, now: Timestamp) -> Route {
        if self.deciding(now) {
            return Route::Here;
        }
        match &self.observed {
            Some((r, _)) if r.holder != self.me && !r.holder.is_empty() && !self.expired(now) => {
                Route::Forward(r.address.clone())
            }
            _ => Route::Nobody,
        }
    }

    /// Forget this replica's renewals (it stepped down, or restarted).
    pub fn step_down(&mut self) {
        self.renewed = None;
        if self
            .observed
            .as_ref()
            .is_some_and(|(r, _)| r.holder == self.me)
        {
            self.observed = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(1_800_000_000_000 + ms).expect("time")
    }

    fn written(e: &mut Elector, now: Timestamp) -> Record {
        let Step::Write(r) = e.step(now) else {
            panic!("{} should write at {now}", e.me());
        };
        e.written(r.clone(), now);
        r
    }

    #[test]
    fn the_first_replica_takes_a_missing_lease_and_decides_until_its_renew_deadline() {
        let mut a = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        a.observe(None, at(0));
        written(&mut a, at(0));
        assert_eq!(a.route(at(0)), Route::Here);
        assert_eq!(a.route(at(9_999)), Route::Here);
        assert_eq!(
            a.route(at(10_000)),
            Route::Nobody,
            "past the renew deadline"
        );
        written(&mut a, at(10_500));
        assert_eq!(a.route(at(12_000)), Route::Here, "renewed");
    }

    #[test]
    fn another_replica_forwards_to_the_holder_and_takes_over_only_after_a_whole_lease_unrenewed() {
        let mut a = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        let mut b = Elector::new("b", "https://b", Terms::of_lease(Duration::from_secs(15)));
        a.observe(None, at(0));
        let r = written(&mut a, at(0));
        b.observe(Some(r.clone()), at(1_000));
        assert_eq!(b.step(at(1_000)), Step::Wait);
        assert_eq!(b.route(at(1_000)), Route::Forward("https://a".into()));
        // Seen unchanged from 1 s: b waits until 16 s by its own clock, whatever the record's times say.
        b.observe(Some(r.clone()), at(15_999));
        assert_eq!(b.step(at(15_999)), Step::Wait);
        let taken = written(&mut b, at(16_000));
        assert_eq!(taken.transitions, 1);
        assert_eq!(b.route(at(16_000)), Route::Here);
        // a's own deadline ran out 6 s before: the two never decide at the same time.
        assert!(!a.deciding(at(10_000)));
    }

    #[test]
    fn a_renewal_seen_late_restarts_the_wait() {
        let mut a = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        let mut b = Elector::new("b", "https://b", Terms::of_lease(Duration::from_secs(15)));
        a.observe(None, at(0));
        let r1 = written(&mut a, at(0));
        b.observe(Some(r1), at(0));
        let r2 = written(&mut a, at(2_000));
        b.observe(Some(r2), at(14_000));
        assert_eq!(b.step(at(20_000)), Step::Wait, "r2 first seen at 14 s");
        assert!(matches!(b.step(at(29_000)), Step::Write(_)));
    }

    #[test]
    fn a_restarted_replica_waits_out_a_lease_in_its_own_name() {
        let mut before = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        before.observe(None, at(0));
        let r = written(&mut before, at(0));
        let mut after = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        after.observe(Some(r), at(1_000));
        assert_eq!(after.step(at(1_000)), Step::Wait);
        assert_eq!(
            after.route(at(1_000)),
            Route::Nobody,
            "not its own to forward to either"
        );
        assert!(matches!(after.step(at(16_000)), Step::Write(_)));
    }

    #[test]
    fn a_replica_that_stepped_down_routes_nowhere_until_it_reads_the_lease_again() {
        let mut a = Elector::new("a", "https://a", Terms::of_lease(Duration::from_secs(15)));
        a.observe(None, at(0));
        written(&mut a, at(0));
        a.step_down();
        assert_eq!(a.route(at(1)), Route::Nobody);
        assert!(
            matches!(a.step(at(1)), Step::Write(_)),
            "it may take it again"
        );
    }
}
