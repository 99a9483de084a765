// Warm pools: sandboxes kept restored and ready, so creates of their shape are a claim. Admin
// keys size and shape them.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, mib, usePoll } from "../ui.jsx";

function PoolDialog({ template, onClose, onSaved }) {
  const [form, setForm] = useState({ ...template.pool });
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const set = (k) => (e) => setForm({ ...form, [k]: Number(e.target.value) });
  const save = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      const { size, vcpus, memory_mib, disk_mib } = form;
      await json("PUT", `/v1/templates/${encodeURIComponent(template.id)}/pool`, { body: { size, vcpus, memory_mib, disk_mib } });
      onSaved();
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title={`Warm pool of ${template.id}`}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="pool" disabled={busy}>
            {busy ? <Spinner label="Saving" /> : "Save"}
          </button>
        </>
      }
    >
      <form id="pool" class="grid2" onSubmit={save}>
        <Field label="Members" hint="0 turns the pool off">
          <input name="size" type="number" min="0" value={form.size} onInput={set("size")} />
        </Field>
        <Field label="vCPUs">
          <input name="vcpus" type="number" min="1" value={form.vcpus} onInput={set("vcpus")} />
        </Field>
        <Field label="Memory (MiB)">
          <input name="memory_mib" type="number" min="128" value={form.memory_mib} onInput={set("memory_mib")} />
        </Field>
        <Field label="Disk (MiB)">
          <input name="disk_mib" type="number" min="256" value={form.disk_mib} onInput={set("disk_mib")} />
        </Field>
      </form>
      <p class="muted small">Creates of exactly this shape, without a client-chosen id or volumes, claim a ready member in milliseconds.</p>
      <ErrorBox error={error} title="Not saved" />
    </Dialog>
  );
}

export function Pools({ me }) {
  const { data, error, loading, reload } = usePoll(() => get("/v1/templates"), 3000);
  const [editing, setEditing] = useState(null);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Warm pools" subtitle="Sandboxes kept restored and running, so a create is a claim, not a boot." />
      <ErrorBox error={error} title="Pools not loaded" />
      {loading && !data ? (
        <Spinner label="Loading pools" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No templates, so no pools" />
        </div>
      ) : (
        <div class="card">
          <table class="table" id="pools">
            <thead>
              <tr>
                <th>Template</th>
                <th>Ready</th>
                <th>Shape</th>
                <th>Filling</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((t) => (
                <tr key={t.id}>
                  <td>{t.id}</td>
                  <td>
                    {t.pool.size ? (
                      <div class="meter inline">
                        <div class="meter-bar">
                          <div class="meter-fill" style={{ width: `${Math.min(100, (100 * t.pool.ready) / t.pool.size)}%` }} />
                        </div>
                        <span class="muted small">
                          {t.pool.ready} / {t.pool.size}
                        </span>
                      </div>
                    ) : (
                      <span class="muted">off</span>
                    )}
                  </td>
                  <td class="muted">
                    {t.pool.vcpus} vCPU · {mib(t.pool.memory_mib)} · {mib(t.pool.disk_mib)} disk
                  </td>
                  <td class="muted">{t.pool.starting ? `${t.pool.starting} starting` : "—"}</td>
                  <td class="right">
                    {me.admin ? (
                      <button class="ghost small" onClick={() => setEditing(t)}>
                        Change
                      </button>
                    ) : null}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {!me.admin && <p class="muted small">Sizing pools takes an admin key.</p>}
      {editing && (
        <PoolDialog
          template={editing}
          onClose={() => setEditing(null)}
          onSaved={() => {
            setEditing(null);
            reload();
          }}
        />
      )}
    </section>
  );
}
