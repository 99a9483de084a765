// Tenants and their API keys, for admin keys (the operators of the deployment). A new key is
// shown once, in the dialog that made it: the API keeps only its hash.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, ago, mib, usePoll, when } from "../ui.jsx";

const tenantPath = (id, rest = "") => `/v1/tenants/${encodeURIComponent(id)}${rest}`;

function NewTenant({ onClose }) {
  const [name, setName] = useState("");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const made = await json("POST", "/v1/tenants", { body: { name: name.trim() } });
      location.hash = `#/tenants/${encodeURIComponent(made.id)}`;
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title="New tenant"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="tenant" disabled={busy || !name.trim()}>
            {busy ? <Spinner label="Creating" /> : "Create tenant"}
          </button>
        </>
      }
    >
      <form id="tenant" onSubmit={submit}>
        <Field label="Name" hint="unique: letters, digits and . _ @ - (a letter or digit first)">
          <input name="tenant-name" value={name} onInput={(e) => setName(e.target.value)} placeholder="team-research" autofocus />
        </Field>
      </form>
      <p class="muted small">A tenant starts with no keys and the deployment's default quotas. Make it a key next.</p>
      <ErrorBox error={error} title="Not created" />
    </Dialog>
  );
}

export function Tenants() {
  const { data, error, loading } = usePoll(() => get("/v1/tenants"), 10000);
  const [creating, setCreating] = useState(false);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Tenants" subtitle="Every tenant of this deployment, what it holds now, and its API keys.">
        <button class="primary" onClick={() => setCreating(true)}>
          New tenant
        </button>
      </PageHeader>
      <ErrorBox error={error} title="Tenants not loaded" />
      {loading && !data ? (
        <Spinner label="Loading tenants" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No tenants" />
        </div>
      ) : (
        <div class="card">
          <table class="table" id="tenants">
            <thead>
              <tr>
                <th>Name</th>
                <th>ID</th>
                <th>Sandboxes</th>
                <th>Holding</th>
                <th>Keys</th>
                <th>Created</th>
              </tr>
            </thead>
            <tbody>
              {items.map((t) => (
                <tr key={t.id} data-id={t.id}>
                  <td>
                    <a href={`#/tenants/${encodeURIComponent(t.id)}`}>{t.name}</a>
                  </td>
                  <td class="mono muted">{t.id}</td>
                  <td>{t.sandboxes}</td>
                  <td class="muted">{t.sandboxes ? `${t.vcpus} vCPU · ${mib(t.memory_mib)}` : "—"}</td>
                  <td>{t.keys}</td>
                  <td class="muted" title={when(t.created_at)}>
                    {ago(t.created_at)}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {creating && <NewTenant onClose={() => setCreating(false)} />}
    </section>
  );
}

// The key, once: selected for copying by hand, and a button that copies it.
function ShownOnce({ made }) {
  const [copied, setCopied] = useState(null);
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(made.key);
      setCopied("Copied");
    } catch {
      setCopied("The browser refused: select the key and copy it");
    }
  };
  return (
    <>
      <div class="notice" role="status">
        <strong>Copy this key now: you will not see it again.</strong> Only its hash is kept, so neither the API nor this console can show it later.
      </div>
      <Field label={`Key ${made.id}${made.name ? ` (${made.name})` : ""}`}>
        <div class="copy-row">
          <input id="new-key" class="mono" readonly value={made.key} onFocus={(e) => e.target.select()} />
          <button class="primary" id="copy-key" onClick={copy}>
            Copy
          </button>
        </div>
      </Field>
      {copied && <p class="muted small" id="copy-status">{copied}</p>}
    </>
  );
}

function NewKey({ tenant, onClose, onMade }) {
  const [name, setName] = useState("");
  const [admin, setAdmin] = useState(false);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const [made, setMade] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      setMade(await json("POST", tenantPath(tenant.id, "/keys"), { body: { name: name.trim(), admin } }));
      onMade();
    } catch (err) {
      setError(err);
    }
    setBusy(false);
  };
  if (made) {
    return (
      <Dialog
        title={`New key of ${tenant.name}`}
        onClose={onClose}
        footer={
          <button class="primary" onClick={onClose}>
            Done
          </button>
        }
      >
        <ShownOnce made={made} />
      </Dialog>
    );
  }
  return (
    <Dialog
      title={`New key of ${tenant.name}`}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="key" disabled={busy}>
            {busy ? <Spinner label="Creating" /> : "Create key"}
          </button>
        </>
      }
    >
      <form id="key" onSubmit={submit}>
        <Field label="Label" hint="optional: who or what uses it">
          <input name="key-name" value={name} onInput={(e) => setName(e.target.value)} placeholder="ci" autofocus />
        </Field>
        <label class="check">
          <input name="key-admin" type="checkbox" checked={admin} onChange={(e) => setAdmin(e.target.checked)} />
          <span>
            Admin key <span class="muted small">— an operator's: manages every tenant and its keys, builds templates, sizes warm pools</span>
          </span>
        </label>
      </form>
      <ErrorBox error={error} title="Not created" />
    </Dialog>
  );
}

function Rename({ tenant, onClose, onDone }) {
  const [name, setName] = useState(tenant.name);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      await json("PATCH", tenantPath(tenant.id), { body: { name: name.trim() } });
      onDone();
      onClose();
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title={`Rename ${tenant.name}`}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="rename" disabled={busy || !name.trim() || name.trim() === tenant.name}>
            {busy ? <Spinner label="Renaming" /> : "Rename"}
          </button>
        </>
      }
    >
      <form id="rename" onSubmit={submit}>
        <Field label="New name" hint="unique: letters, digits and . _ @ - (a letter or digit first)">
          <input name="tenant-rename" value={name} onInput={(e) => setName(e.target.value)} autofocus />
        </Field>
      </form>
      <p class="muted small">Its keys, sandboxes and usage stay as they are.</p>
      <ErrorBox error={error} title="Not renamed" />
    </Dialog>
  );
}

// Deleting a tenant: what it deletes is stated first, and the tenant's name typed to confirm.
function Delete({ tenant, me, onClose }) {
  const stated = usePoll(() => get(tenantPath(tenant.id, "/deletion")), 0, [tenant.id]);
  const [typed, setTyped] = useState("");
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const own = tenant.id === me.tenant_id;
  const go = async () => {
    setBusy(true);
    setError(null);
    try {
      await json("DELETE", tenantPath(tenant.id), { query: { confirm: typed } });
      location.hash = "#/tenants";
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  const d = stated.data;
  return (
    <Dialog
      title={`Delete tenant ${tenant.name}?`}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="danger" id="delete-tenant" disabled={busy || own || typed !== tenant.name} onClick={go}>
            {busy ? <Spinner label="Deleting" /> : "Delete tenant"}
          </button>
        </>
      }
    >
      <ErrorBox error={stated.error} title="What it holds was not read" />
      {!d ? (
        <Spinner label="Reading what it holds" />
      ) : (
        <div id="deletion">
          <p>This cannot be undone. At once:</p>
          <ul>
            <li>its {d.keys} active key(s) are revoked;</li>
            <li>its {d.secrets} secret(s) and {d.webhooks} webhook(s) are removed;</li>
            <li>
              its <strong>{d.sandboxes.length} sandbox(es)</strong> are deleted, stopped and their disks and snapshots removed{d.sandboxes.length ? `: ${d.sandboxes.slice(0, 5).join(", ")}${d.sandboxes.length > 5 ? "…" : ""}` : ""};
            </li>
            <li>
              its <strong>{d.volumes.length} volume(s)</strong> are deleted, data and all, once no sandbox has them.
            </li>
          </ul>
          <p class="muted small">Its usage and audit entries stay; its name is freed.</p>
        </div>
      )}
      {own ? (
        <p class="error">This is your own tenant: delete it with another tenant's admin key.</p>
      ) : (
        <Field label={`Type ${tenant.name} to confirm`}>
          <input name="confirm-name" value={typed} onInput={(e) => setTyped(e.target.value)} autocomplete="off" />
        </Field>
      )}
      <ErrorBox error={error} title="Not deleted" />
    </Dialog>
  );
}

export function TenantPage({ id, me }) {
  const tenant = usePoll(() => get(tenantPath(id)), 10000, [id]);
  const keys = usePoll(() => get(tenantPath(id, "/keys")), 10000, [id]);
  const [creating, setCreating] = useState(false);
  const [revoking, setRevoking] = useState(null);
  const [renaming, setRenaming] = useState(false);
  const [deleting, setDeleting] = useState(false);
  const t = tenant.data;
  if (tenant.error && !t) {
    return (
      <section>
        <PageHeader title={id} />
        <ErrorBox error={tenant.error} title={tenant.error.status === 404 ? "No such tenant" : "Not loaded"} />
        <a href="#/tenants">← All tenants</a>
      </section>
    );
  }
  if (!t) return <Spinner label="Loading" />;
  const items = keys.data?.items || [];
  return (
    <section>
      <div class="crumbs">
        <a href="#/tenants">Tenants</a> / <span>{t.name}</span>
      </div>
      <PageHeader title={t.name} subtitle={`${t.id} · created ${ago(t.created_at)} · ${t.sandboxes} sandboxes`}>
        <button class="ghost" onClick={() => setRenaming(true)}>
          Rename
        </button>
        <button class="danger" onClick={() => setDeleting(true)}>
          Delete
        </button>
        <button class="primary" onClick={() => setCreating(true)}>
          New key
        </button>
      </PageHeader>
      {renaming && <Rename tenant={t} onClose={() => setRenaming(false)} onDone={() => tenant.reload()} />}
      {deleting && <Delete tenant={t} me={me} onClose={() => setDeleting(false)} />}
      <h2 class="section">API keys</h2>
      <ErrorBox error={keys.error} title="Keys not loaded" />
      {keys.loading && !keys.data ? (
        <Spinner label="Loading keys" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No active keys">Nothing can sign in as this tenant until it has a key.</Empty>
        </div>
      ) : (
        <div class="card">
          <table class="table" id="keys">
            <thead>
              <tr>
                <th>Key</th>
                <th>Label</th>
                <th>Kind</th>
                <th>Created</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((k) => (
                <tr key={k.id} data-id={k.id}>
                  <td class="mono">
                    sk_space_{k.id}_••• {k.id === me.key_id && <span class="pill">this key</span>}
                  </td>
                  <td>{k.name || <span class="muted">—</span>}</td>
                  <td>{k.admin ? <span class="pill">admin</span> : <span class="muted">tenant</span>}</td>
                  <td class="muted" title={when(k.created_at)}>
                    {ago(k.created_at)}
                  </td>
                  <td class="right">
                    <button class="danger small" onClick={() => setRevoking(k)}>
                      Revoke
                    </button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {creating && <NewKey tenant={t} onClose={() => setCreating(false)} onMade={() => { keys.reload(); tenant.reload(); }} />}
      {revoking && (
        <Confirm
          title={`Revoke key ${revoking.id}?`}
          action="Revoke"
          danger
          onClose={() => setRevoking(null)}
          onConfirm={async () => {
            await json("DELETE", tenantPath(t.id, `/keys/${encodeURIComponent(revoking.id)}`));
            await Promise.all([keys.reload(), tenant.reload()]);
          }}
        >
          <p>Its next call is refused, at once. This cannot be undone: a new key has to be made instead.</p>
          {revoking.id === me.key_id && <p class="error">This is the key you are signed in with: the console will sign you out.</p>}
        </Confirm>
      )}
    </section>
  );
}
