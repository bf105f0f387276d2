//! Each request's mailbox: what its worker's root has for it (a store answer, a wait's end,
//! a caller's lookup answer, the answer to its detached write), left by the root and taken
//! by the request in its own scheduled hook. Envoy runs a request's code only in that
//! request's hooks; the root never acts on a request from another request's hook.
//!
//! A request opens its mailbox, with its scheduler, when its journey first waits for the
//! root; it closes it when it ends. Everything here is the worker's own (thread-local), as
//! the root and its requests are.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use idempotency_core::mail::Mail;

use crate::inbox::Reply;
use crate::ticker::Wake;

/// A request is owed at most a few letters at once (one answer per thing it waits for);
/// past this a letter is handed back undelivered rather than queued without end.
const MAX_LETTERS: usize = 16;

pub enum Letter {
    /// Core's, for the request's journey.
    Core(Box<Mail>),
    /// The main thread's root ran this request's detached write: its answer to send.
    DetachedReply(Box<Reply>),
}

impl Letter {
    fn context_id(&self) -> u32 {
        match self {
            Letter::Core(mail) => mail.context_id(),
            Letter::DetachedReply(reply) => reply.context_id,
        }
    }
}

struct Mailbox {
    letters: VecDeque<Letter>,
    wake: Arc<dyn Wake>,
}

thread_local! {
    static MAILBOXES: RefCell<HashMap<u32, Mailbox>> = RefCell::new(HashMap::new());
}

/// Request `context_id` takes letters from now on; `wake` brings it to its scheduled hook.
pub fn open(context_id: u32, wake: Arc<dyn Wake>) {
    let _ = MAILBOXES.try_with(|boxes| {
        boxes.borrow_mut().entry(context_id).or_insert(Mailbox {
            letters: VecDeque::new(),
            wake,
        });
    });
}

/// Leaves `letter` in its request's mailbox and wakes the request; gives it back when the
/// request has no mailbox (it is gone, or never waited for the root) or it is full.
pub fn post(letter: Letter) -> Result<(), Letter> {
    let context_id = letter.context_id();
    let mut letter = Some(letter);
    let wake = MAILBOXES
        .try_with(|boxes| {
            let mut boxes = boxes.borrow_mut();
            let mailbox = boxes.get_mut(&context_id)?;
            if mailbox.letters.len() >= MAX_LETTERS {
                return None;
            }
            mailbox.letters.extend(letter.take());
            Some(Arc::clone(&mailbox.wake))
        })
        .ok()
        .flatten();
    match (letter, wake) {
        (None, Some(wake)) => {
            // Committed outside the borrow: keep the mailboxes free whatever it does.
            wake.wake();
            Ok(())
        }
        (Some(letter), _) => Err(letter),
        (None, None) => Ok(()),
    }
}

/// The letters waiting for `context_id`, oldest first.
pub fn take(context_id: u32) -> Vec<Letter> {
    MAILBOXES
        .try_with(|boxes| {
            boxes
                .borrow_mut()
                .get_mut(&context_id)
                .map(|mailbox| mailbox.letters.drain(..).collect())
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

/// Puts `letters` back at the front of `context_id`'s mailbox, in order, and wakes it again
/// (they could not be taken now); handed to nobody if the mailbox went meanwhile.
pub fn put_back(context_id: u32, letters: Vec<Letter>) {
    let wake = MAILBOXES
        .try_with(|boxes| {
            let mut boxes = boxes.borrow_mut();
            let mailbox = boxes.get_mut(&context_id)?;
            for letter in letters.into_iter().rev() {
                mailbox.letters.push_front(letter);
            }
            Some(Arc::clone(&mailbox.wake))
        })
        .ok()
        .flatten();
    if let Some(wake) = wake {
        wake.wake();
    }
}

/// The request is ending: its mailbox goes, and what it held comes back to be handled as
/// undelivered.
pub fn close(context_id: u32) -> Vec<Letter> {
    MAILBOXES
        .try_with(|boxes| boxes.borrow_mut().remove(&context_id))
        .ok()
        .flatten()
        .map(|mailbox| mailbox.letters.into())
        .unwrap_or_default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn reply(context_id: u32) -> Letter {
        Letter::DetachedReply(Box::new(Reply {
            context_id,
            status: 201,
            headers: Vec::new(),
            body: Vec::new(),
            trailers: Vec::new(),
        }))
    }

    #[test]
    fn a_letter_wakes_its_request_and_one_nobody_takes_comes_back() {
        assert!(post(reply(900)).is_err(), "no mailbox: handed back");
        let woken = Arc::new(Count::default());
        open(900, Arc::clone(&woken) as Arc<dyn Wake>);
        for _ in 0..MAX_LETTERS {
            assert!(post(reply(900)).is_ok());
        }
        assert_eq!(woken.0.load(Ordering::SeqCst), MAX_LETTERS);
        assert!(post(reply(900)).is_err(), "full: handed back, not dropped");
        assert_eq!(take(900).len(), MAX_LETTERS);
        assert!(post(reply(900)).is_ok());
        assert_eq!(close(900).len(), 1, "what it never took comes back");
        assert!(post(reply(900)).is_err(), "closed");
    }
}
