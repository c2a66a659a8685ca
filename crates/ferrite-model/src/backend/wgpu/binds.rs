//! Bind groups kept across steps: a decode binds the same weights and activations to the
//! same kernels as the step before, and making a bind group costs more than recording its
//! launch. A group no step has used for a few steps is dropped (it keeps its buffers alive).

use std::collections::HashMap;

/// Steps a group is kept unused (a draft model's steps come between the target's).
const KEEP: u64 = 4;

type Key = (wgpu::BindGroupLayout, Vec<wgpu::Buffer>);

#[derive(Default)]
pub struct BindGroups {
    groups: HashMap<Key, (wgpu::BindGroup, u64)>,
    step: u64,
}

impl BindGroups {
    /// `buffers` bound in order to `layout`'s bindings.
    pub fn get(
        &mut self,
        device: &wgpu::Device,
        (layout, label): (&wgpu::BindGroupLayout, &str),
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        let key = (layout.clone(), buffers.iter().map(|&b| b.clone()).collect());
        let step = self.step;
        let entry = self.groups.entry(key).or_insert_with(|| {
            let entries: Vec<_> = buffers
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource: b.as_entire_binding(),
                })
                .collect();
            let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout,
                entries: &entries,
            });
            (group, step)
        });
        entry.1 = step;
        entry.0.clone()
    }

    /// After a step is recorded: drops the groups unused for [`KEEP`] steps.
    pub fn end_step(&mut self) {
        let step = self.step;
        self.groups.retain(|_, (_, used)| step - *used < KEEP);
        self.step += 1;
    }
}
