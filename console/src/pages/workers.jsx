// Workers, for admin keys: each host's capacity, what admission counts in use (memory as the
// worker measured it), and what is placed there.
import { get } from "../api.js";
import { Empty, ErrorBox, PageHeader, Spinner, ago, mib, usePoll } from "../ui.jsx";

function Use({ used, total, label }) {
  const share = total ? Math.min(100, (100 * used) / total) : 0;
  return (
    <div class="meter inline">
      <div class="meter-bar">
        <div class={`meter-fill${share >= 100 ? " full" : ""}`} style={{ width: `${share}%` }} />
      </div>
      <span class="muted small">{label}</span>
    </div>
  );
}

export function Workers() {
  const { data, error, loading } = usePoll(() => get("/v1/workers"), 5000);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Workers" subtitle="The hosts sandboxes run on: what each admits, what it holds, and whether it takes work." />
      <ErrorBox error={error} title="Workers not loaded" />
      {loading && !data ? (
        <Spinner label="Loading workers" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No workers">A worker registers itself when it starts.</Empty>
        </div>
      ) : (
        <div class="card">
          <table class="table" id="workers">
            <thead>
              <tr>
                <th>Worker</th>
                <th>State</th>
                <th>Sandboxes</th>
                <th>vCPUs</th>
                <th>Memory (measured)</th>
                <th>Disk</th>
              </tr>
            </thead>
            <tbody>
              {items.map((w) => (
                <tr key={w.id} data-id={w.id}>
                  <td class="mono">{w.id}</td>
                  <td>
                    <span class={`badge badge-${w.state === "active" ? "running" : "error"}`} data-state={w.state}>
                      <span class="dot" />
                      {w.state}
                    </span>
                    {w.problem && <div class="muted small">{w.problem}</div>}
                  </td>
                  <td>
                    {w.sandboxes} <span class="muted small">({w.pool_members} in pools)</span>
                  </td>
                  <td>
                    <Use used={w.vcpus_used} total={w.vcpus} label={`${w.vcpus_used} / ${w.vcpus}`} />
                  </td>
                  <td title={`guest RAM given: ${mib(w.guest_memory_mib)}; a VMM's overhead: ${mib(w.overhead_mib)}`}>
                    <Use used={w.memory_used_mib} total={w.memory_mib} label={`${mib(w.memory_used_mib)} / ${mib(w.memory_mib)}`} />
                    <div class="muted small">
                      {mib(w.guest_memory_mib)} guest RAM · measured {ago(w.measured_at)}
                    </div>
                  </td>
                  <td>
                    {w.disk_mib ? <Use used={w.disk_used_mib} total={w.disk_mib} label={`${mib(w.disk_used_mib)} / ${mib(w.disk_mib)}`} /> : <span class="muted">not reported</span>}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
    </section>
  );
}
