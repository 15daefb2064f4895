//! AdamW with global-norm gradient clipping and a warm-up + cosine learning-rate schedule, on
//! named candle variables, for both trainers. Written out (rather than `candle_nn::AdamW`) so
//! its moments can be saved in a checkpoint, a resumed run continues exactly, and an extended
//! run keeps its moments and its place in the schedule.

use anyhow::{bail, Result};
use candle_core::{Tensor, Var};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWSettings {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWSettings {
    fn default() -> Self {
        Self { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// Learning rate at `step` (0-based) of `total`: linear warm-up over the first `warmup`
/// steps, then cosine decay to 0 at `total`.
pub fn scheduled_lr(peak: f64, step: usize, total: usize, warmup: usize) -> f64 {
    LrSchedule::new(peak, total, warmup).lr(step)
}

/// The learning rate of every step: linear warm-up to `peak`, then cosine decay from
/// `decay_lr` at `decay_start` to 0 at `total`. A fresh run decays from the peak right after
/// warm-up; [`LrSchedule::extend`] makes a longer run continue from where it is, without a
/// second warm-up and without a jump.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup: usize,
    pub total: usize,
    pub decay_start: usize,
    pub decay_lr: f64,
}

impl LrSchedule {
    /// A run of `total` steps warming up over the fraction `warmup` of them.
    pub fn for_run(peak: f64, warmup: f64, total: usize) -> Self {
        Self::new(peak, total, (warmup * total as f64).ceil() as usize)
    }

    pub fn new(peak: f64, total: usize, warmup: usize) -> Self {
        let warmup = warmup.max(1);
        Self { peak, warmup, total, decay_start: warmup, decay_lr: peak }
    }

    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup && self.decay_start == self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.decay_start).max(1) as f64;
        let t = (step.saturating_sub(self.decay_start) as f64 / span).min(1.0);
        self.decay_lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }

    /// The same run made `total` steps long at step `at`: from `at` on, the rate decays from
    /// its value at `at` to 0 at `total` (still warming up: warm-up finishes first).
    pub fn extend(&self, at: usize, total: usize) -> Self {
        if total == self.total {
            return *self;
        }
        if at <= self.decay_start {
            return Self { total, ..*self };
        }
        Self { total, decay_start: at, decay_lr: self.lr(at), ..*self }
    }
}

/// Adds one sequence's gradients into the step's per-parameter sums.
pub fn accumulate_grads(
    sums: &mut [Option<Tensor>],
    g: &candle_core::backprop::GradStore,
    params: &[(String, Var)],
) -> Result<()> {
    for (slot, (_, p)) in sums.iter_mut().zip(params) {
        if let Some(gp) = g.get(p.as_tensor()) {
            *slot = Some(match slot.take() {
                Some(acc) => (acc + gp)?,
                None => gp.clone(),
            });
        }
    }
    Ok(())
}

/// The step's gradients, zero for parameters no sequence reached.
pub fn finish_grads(sums: Vec<Option<Tensor>>, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
    Ok(sums
        .into_iter()
        .zip(params)
        .map(|(g, (_, p))| g.map_or_else(|| p.zeros_like(), Ok))
        .collect::<candle_core::Result<_>>()?)
}

pub struct AdamW {
    pub settings: AdamWSettings,
    params: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Updates applied so far (for bias correction).
    pub t: usize,
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, settings: AdamWSettings) -> Result<Self> {
        let m = params.iter().map(|(_, p)| p.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        let v = m.clone();
        Ok(Self { settings, params, m, v, t: 0 })
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Clips `grads` (one per parameter, in order) to global L2 norm `max_norm` and applies
    /// one update at learning rate `lr`. Returns the norm before clipping.
    pub fn step(&mut self, grads: &[Tensor], lr: f64, max_norm: f64) -> Result<f64> {
        if grads.len() != self.params.len() {
            bail!("{} gradients for {} parameters", grads.len(), self.params.len());
        }
        let mut sq = 0f64;
        for g in grads {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        let norm = sq.sqrt();
        if !norm.is_finite() {
            bail!("the gradient norm is {norm}: the loss diverged");
        }
        let scale = if max_norm > 0.0 && norm > max_norm { max_norm / norm } else { 1.0 };
        self.t += 1;
        let s = self.settings;
        let (c1, c2) = (1.0 - s.beta1.powi(self.t as i32), 1.0 - s.beta2.powi(self.t as i32));
        for (i, ((_, p), g)) in self.params.iter().zip(grads).enumerate() {
            let g = (g * scale)?;
            self.m[i] = ((&self.m[i] * s.beta1)? + (&g * (1.0 - s.beta1))?)?;
            self.v[i] = ((&self.v[i] * s.beta2)? + (g.sqr()? * (1.0 - s.beta2))?)?;
            let m_hat = (&self.m[i] / c1)?;
            let v_hat = (&self.v[i] / c2)?;
            let update = (m_hat / (v_hat.sqrt()? + s.eps)?)?;
            let decayed = (p.as_tensor() * (1.0 - lr * s.weight_decay))?;
            p.set(&(decayed - (update * lr)?)?)?;
        }
        Ok(norm)
    }

    /// The moments as named tensors (`adam.m.NAME`, `adam.v.NAME`) for a checkpoint.
    pub fn state(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.insert(format!("adam.m.{name}"), self.m[i].clone());
            out.insert(format!("adam.v.{name}"), self.v[i].clone());
        }
        out
    }

    /// Restores the moments written by [`Self::state`] and the update count.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, t: usize) -> Result<()> {
        for (i, (name, p)) in self.params.iter().enumerate() {
            for (slot, kind) in [(&mut self.m[i], "m"), (&mut self.v[i], "v")] {
                let key = format!("adam.{kind}.{name}");
                let Some(value) = tensors.get(&key) else { bail!("the checkpoint has no `{key}`") };
                if value.dims() != p.dims() {
                    bail!("checkpoint `{key}` has shape {:?}, the parameter {:?}", value.dims(), p.dims());
                }
                *slot = value.clone();
            }
        }
        self.t = t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        assert!((scheduled_lr(1.0, 0, 100, 4) - 0.25).abs() < 1e-12);
        assert!((scheduled_lr(1.0, 3, 100, 4) - 1.0).abs() < 1e-12);
        assert!((scheduled_lr(1.0, 4, 100, 4) - 1.0).abs() < 1e-12);
        assert!(scheduled_lr(1.0, 52, 100, 4) < 0.51 && scheduled_lr(1.0, 52, 100, 4) > 0.49);
        assert!(scheduled_lr(1.0, 100, 100, 4).abs() < 1e-12);
    }

    #[test]
    fn an_extended_schedule_continues_without_a_jump_or_a_second_warmup() {
        let s = LrSchedule::new(1.0, 100, 4);
        let e = s.extend(60, 200);
        assert!((e.lr(60) - s.lr(60)).abs() < 1e-12);
        assert!(e.lr(61) < e.lr(60) && e.lr(61) > s.lr(61));
        assert!(e.lr(200).abs() < 1e-12);
        // Extending during warm-up keeps the warm-up and stretches the decay.
        let w = s.extend(2, 200);
        assert_eq!(w.lr(1), s.lr(1));
        assert!((w.lr(4) - 1.0).abs() < 1e-12);
        // Extending twice chains.
        let e2 = e.extend(150, 300);
        assert!((e2.lr(150) - e.lr(150)).abs() < 1e-12);
        assert_eq!(s.extend(50, 100), s);
    }

    #[test]
    fn adamw_minimises_a_quadratic_and_clips() {
        let x = Var::new(&[3.0f32, -2.0], &Device::Cpu).unwrap();
        let mut opt =
            AdamW::new(vec![("x".into(), x.clone())], AdamWSettings { weight_decay: 0.0, ..Default::default() })
                .unwrap();
        for _ in 0..400 {
            let loss = x.as_tensor().sqr().unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let g = grads.get(x.as_tensor()).unwrap().clone();
            opt.step(&[g], 0.05, 1.0).unwrap();
        }
        let v: Vec<f32> = x.as_tensor().to_vec1().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.05), "{v:?}");
        // A huge gradient is clipped to norm 1 before the moments see it.
        let norm = opt.step(&[Tensor::new(&[300.0f32, 400.0], &Device::Cpu).unwrap()], 0.0, 1.0).unwrap();
        assert!((norm - 500.0).abs() < 1e-3);
    }
}
