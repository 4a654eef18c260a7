//! Choosing and checking plans from measured costs: [`planner`] (AHD: the
//! best stage cuts and replica counts for W slots, exact) and [`simulate`]
//! (a step-by-step model of a plan, to predict and to check it).
//!
//! The plans themselves, and every schedule name, are `pipebd-core`'s
//! ([`crate::Plan`], [`crate::Schedule`]).

pub mod planner;
pub mod simulate;
