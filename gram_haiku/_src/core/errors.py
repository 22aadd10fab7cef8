"""Error messages, kept as constants so that tests can match them.

Each says what went wrong, where (module name, shapes) and what to do.
"""

PROBE_SHAPE_MISMATCH = (
    "gram_haiku: the Gram probe of module '{module}' has shape {got}, but "
    "the example axis calls for {expected} (mode {mode!r}). "
    "Layer input shape: {x_shape}; example axis rule: {rule}.\n"
    "What to do: let gram_haiku.value_grad_and_gram size the probes, or call "
    "gram_haiku.resize_probes(state, batch_size) before taking the gradient "
    "with respect to the probes. If the wrong axis was picked as the example "
    "axis (e.g. an inner hk.vmap over heads or set elements in an explicitly "
    "batched model), choose it with gram_haiku.track(example_axis=0) or "
    "track(example_axis='<vmap axis_name>').")

NAMED_AXIS_NOT_FOUND = (
    "gram_haiku: module '{module}' was asked for the Gram over the vmap axis "
    "named {axis!r} (track(example_axis={axis!r})), but no vmap with that "
    "axis_name encloses the layer inside the differentiated function.\n"
    "What to do: map the examples with hk.vmap(..., axis_name={axis!r}) "
    "(or jax.vmap) inside the function you differentiate, or use "
    "track(example_axis=0) for an explicitly batched input.")

NO_EXAMPLE_AXIS = (
    "gram_haiku: module '{module}' received an input of shape {shape}, which "
    "has no leading axis to use as the example axis ({rule}).\n"
    "What to do: pass a batch with a leading example axis, or vmap the "
    "per-example code inside the differentiated function.")

PARAMS_SPAN_EXAMPLE_AXIS = (
    "gram_haiku: module '{module}' has parameters ({params}) that span the "
    "last {feature_ndim} axes of its input of shape {shape}, axis "
    "{position} (the example axis) included: each example would be "
    "scaled or shifted by its own entries (e.g. hk.LayerNorm or hk.RMSNorm "
    "with param_axis=0 on a batch), which this layer's Gram rule does not "
    "cover.\n"
    "What to do: put the parameter axes after the example axis (param_axis "
    "counted from the end, e.g. param_axis=-1), or apply the module to one "
    "example at a time under hk.vmap, where axis 0 is within the example.")

PROBE_BATCHED = (
    "gram_haiku: the Gram probe of module '{module}' (shape {shape}) is "
    "batched by vmap (mapped axis {dim}). The probe is one (B, B) matrix for "
    "the whole batch and must not be mapped. Two things map it: a jax.vmap "
    "that maps the Haiku state, and, under hk.vmap over the examples, an "
    "hk.cond or hk.switch whose predicate or index differs per example "
    "(vmap then runs every branch and maps every operand, the state "
    "included).\n"
    "What to do: pass the Haiku state with in_axes=None to jax.vmap, or use "
    "hk.vmap, which never maps state; for a per-example branch, compute the "
    "branches and pick per example with jnp.where(pred, a, b) (what vmap of "
    "a cond computes anyway), which is exact.")

PARAMS_BATCHED = (
    "gram_haiku: the parameters {params} of module '{module}' are mapped by "
    "vmap (for example an ensemble built with hk.lift and jax.vmap). Per-example Grams "
    "of vmapped parameters are not supported.\n"
    "What to do: run this module outside gram_haiku.track(), or vmap only "
    "the inputs and keep the parameters shared.")

SHARED_LAYER = (
    "gram_haiku: module '{module}' was called more than once in one call of "
    "the transformed function (twice in a row, in two gram_haiku.track() "
    "contexts, or under hk.remat, hk.vmap or in an hk.cond branch and again "
    "elsewhere), or in two calls given the same state (a siamese loss "
    "f.apply(..., x1) - f.apply(..., x2)). Its per-example gradient is the "
    "sum over "
    "the calls, so its Gram needs the cross terms between calls; on the raw "
    "jax.grad path nothing accumulates per-example gradients, and the sum "
    "of per-call Grams would be silently wrong.\n"
    "What to do: use gram_haiku.value_grad_and_gram, which detects shared "
    "modules and accumulates their per-example gradients (cross terms "
    "included), or create one module per use.")

LOOP_BODY = (
    "gram_haiku: module '{module}' is applied inside a loop body (lax.scan, "
    "hk.scan, hk.dynamic_unroll, fori_loop or while_loop) with parameters "
    "shared across iterations. Its per-example gradient is the sum over "
    "iterations; on the raw jax.grad path nothing accumulates it, and "
    "summing per-iteration Grams would be silently wrong.\n"
    "What to do: use gram_haiku.value_grad_and_gram, which accumulates "
    "per-example gradients across iterations (cross terms included). "
    "hk.layer_stack, whose parameters differ per step, needs nothing.")

NOT_SCALAR = (
    "gram_haiku.value_grad_and_gram: apply_fn must return a scalar loss, got "
    "an output of shape {shape} and dtype {dtype}.\n"
    "What to do: reduce the per-example losses with .sum() (the Gram then "
    "equals the reference) or .mean() (the Gram is the reference / B**2).")

NO_PROBES = (
    "gram_haiku.value_grad_and_gram: the Haiku state holds no Gram probe "
    "('gram_probe' entries) and no track() context read a parameter, so "
    "no layer was tracked.\n"
    "What to do: call the model inside `with gram_haiku.track():` in the "
    "function given to hk.transform_with_state, and pass the state returned "
    "by its init.")

NO_GRAM_TO_FORM = (
    "gram_haiku: no layer inside track() was tracked (the Haiku state holds "
    "no 'gram_probe' entry) and no parameter's use is covered by a "
    "program-level rule (a bare weight in x @ W or jnp.einsum, a broadcast "
    "add or mul, a gather), so there is no Gram to form "
    "(track(untracked='warn') names each untracked use).\n"
    "What to do: apply the parameters through tracked layers (hk.Linear, "
    "hk.Conv2D, ...), or use them in one of the forms a program rule reads "
    "(see 'Parameters read from the program' in docs/semantics.rst).")

BAD_BATCH_SIZE = (
    "gram_haiku.resize_probes: batch_size must be a positive int, got "
    "{value!r}.")

MIXED_EXAMPLE_SIZES = (
    "gram_haiku.value_grad_and_gram: the tracked layers see example axes of "
    "different sizes {sizes} (module: size). One Gram needs one set of "
    "examples: every tracked layer must see the batch's examples along its "
    "example axis, and a layer whose input does not hold them (keys and "
    "values computed from an unbatched memory, a learned query, a slice or "
    "a reshape of the batch) sees another size there.\n"
    "What to do: broadcast such an input to the batch first "
    "(jnp.broadcast_to(memory, (B,) + memory.shape), which is exact), apply "
    "that layer outside gram_haiku.track(), or, if an inner vmap's axis was "
    "taken for the examples, choose the axis with "
    "gram_haiku.track(example_axis=...).")

PROBE_REF_TYPE = (
    "gram_haiku: the reference given to jax.vjp(...).with_refs(...) for the "
    "Gram probe of module '{module}' has type {got}, but the probe's "
    "cotangent has type {expected}.\n"
    "What to do: accumulate into jax.new_ref(jnp.zeros_like(probe)), a ref "
    "with the probe's own shape and dtype.")

AMBIGUOUS_EXAMPLE_AXIS = (
    "gram_haiku.value_grad_and_gram: under the default example-axis rule, "
    "some tracked layers take a vmap axis as the example axis ({vmapped}) "
    "and others their input's axis 0 ({explicit}). In an explicitly batched "
    "model with an inner hk.vmap (over heads, ensemble members or set "
    "elements) the default picks the inner vmap, which is not the example "
    "axis, so the Gram would be wrong. Or a tracked layer's input does not "
    "depend on the example (positions from jnp.arange, a constant): it has "
    "no example axis.\n"
    "What to do: say which axis holds the examples: "
    "gram_haiku.track(example_axis=0) for the explicit batch axis (every "
    "vmap is then within-example), or track(example_axis='<axis_name>') for "
    "a named hk.vmap over examples; give every tracked layer an input that "
    "carries the example axis (e.g. positions = ids * 0 + jnp.arange(T)).")

MIXED_USE = (
    "gram_haiku: parameter '{param}' is used both inside a tracked layer "
    "({modules}) and outside it: by `{use}`, outside every tracked layer's "
    "parameters (for example an embedding tied to the output layer, "
    "`h @ embed.embeddings.T`, the same module called again outside the "
    "gram_haiku.track() block, the weight read directly, or the layer "
    "differentiated inside the loss by jax.grad for a gradient penalty, "
    "whose backward pass uses the weight). Its per-example gradient is the "
    "sum of both parts, and the outside part cannot be added to the "
    "layer's here: {why}.\n"
    "What to do: for a tied output layer write "
    "`gram_haiku.unembed(embed, h)` (the same `h @ embed.embeddings.T`, "
    "tracked); otherwise put every use of the module inside "
    "gram_haiku.track() and read the parameter only through its module's "
    "__call__, or use a separate module for the outside use.")

MIXED_OUTPUT_UNUSED = (
    "the layer's own output does not reach the loss")

MIXED_STACKED = (
    "the layer is stacked by hk.layer_stack, whose per-layer stores do not "
    "line up with the parameter's own")

MIXED_REPARAMETRISED = (
    "the layer reads its parameters through a reparametrising getter, "
    "whose per-example gradients are pulled back after the pass")

MIXED_OPERANDS = (
    "the layer reads the parameter as more than one of its operands")

MIXED_NO_SITE = (
    "no program-level rule reads the outside use")

UNTRACKED_PARAM = (
    "gram_haiku: parameter '{param}' (module type {module_type}) is read "
    "inside gram_haiku.track() but no Gram rule covers it, so the Gram leaves "
    "it out (grams.complete is False; grams.coverage lists it).\n"
    "What to do: use a supported layer, write a rule for this module "
    "(gram_haiku.Rule + gram_haiku.register_layer), or choose "
    "track(untracked='ignore' | 'warn' | 'error'). A bare "
    "hk.get_parameter is covered where the program-level rules can follow "
    "its use (the 'Plain JAX and Flax' docs page lists them), not as a "
    "stacked parameter sliced per step (hk.layer_stack, or hk.scan over "
    "stacked parameters): read it through a tracked layer there (hk.Bias, "
    "hk.Linear, ...).")

BARE_UNCOVERED = (
    "gram_haiku.functional: parameter '{param}' of the plain-JAX loss has "
    "no Gram rule, so its per-example gradients cannot be formed.{why}\n"
    "What to do: express its use with a covered primitive (see the "
    "'Plain JAX and Flax' docs page for the list), or compute that part of "
    "the model with a Haiku module inside gram_haiku.track() and use "
    "gram_haiku.value_grad_and_gram.")

BATCHNORM_TRAINING = (
    "gram_haiku: module '{module}' (hk.BatchNorm) runs with "
    "is_training={is_training}, test_local_stats={test_local_stats}: it "
    "normalises every example with statistics of the whole batch, so each "
    "example's loss depends on the other examples and per-example gradients "
    "(hence their Gram) are undefined.\n"
    "What to do: call it with is_training=False (moving averages; then it is "
    "an affine layer and is tracked), replace it with hk.GroupNorm or "
    "hk.LayerNorm, or run it outside gram_haiku.track().")

TRACK_OUTSIDE_TRANSFORM = (
    "gram_haiku.track() was entered outside a Haiku transform. It swaps Haiku "
    "modules for Gram ops as they are called, so it must run inside the "
    "function you give to hk.transform_with_state.\n"
    "What to do: move `with gram_haiku.track():` into that function, around "
    "the model call (see the quickstart in README.md).")

MESH_AXES_UNBOUND = (
    "gram_haiku.{fn}(mesh_axes={axes}): these mesh axes are "
    "not bound here ({error}). mesh_axes names the axes of an enclosing "
    "jax.shard_map over which the examples are split.\n"
    "What to do: call the transformed function inside jax.shard_map(..., "
    "mesh=mesh, in_specs=...) whose batch in_spec is P({axes}, ...), or drop "
    "mesh_axes outside shard_map (jit with NamedSharding needs none).")

BATCH_NOT_SPLIT = (
    "gram_haiku.{fn}(mesh_axes={axes}): the examples are to "
    "be split over these mesh axes, but no batch input varies over them "
    "(inputs {shapes}, varying over {varying}): every device holds the same "
    "examples, and the assembled Gram would count each of them once per "
    "device.\n"
    "What to do: give the batch the in_spec P({axes}, ...) in jax.shard_map, "
    "or drop mesh_axes if the batch is meant to be replicated (each device "
    "then computes the whole Gram).")

EXPLICIT_MESH_NOT_SET = (
    "gram_haiku: an input of a tracked layer ({shape}, {dtype}) is sharded "
    "as {spec} over a mesh with Explicit axes {axes}, but no mesh is set: "
    "JAX needs one to place the Gram contractions over the sharded example "
    "axis.\n"
    "What to do: call the jitted function inside `with jax.set_mesh(mesh):` "
    "(the mesh the batch was placed on), or make the mesh with "
    "axis_types=(jax.sharding.AxisType.Auto,) to let XLA choose the layout.")

PROBE_NOT_VARYING = (
    "gram_haiku: inside shard_map, the input of module '{module}' (shape "
    "{x_shape}) varies over mesh axes {x_axes} but its Gram probe (shape "
    "{probe_shape}) only over {probe_axes}: each device has other examples, "
    "and its Gram cannot be summed across devices (that would be silently "
    "wrong).\n"
    "What to do: pass mesh_axes=... to the gram_haiku transform that runs "
    "this loss (value_grad_and_gram, reweighted_grad, clipped_grad or "
    "cross_gram), naming the mesh axes the examples are split over (here "
    "perhaps mesh_axes={suggest}; leave out axes that split features, not "
    "examples), so that each device gets its rows f32[B_local, B] of the "
    "global Gram (of the block, f32[B_local, V], for cross_gram, whose "
    "queries are split the same way); for several axes pass mesh=mesh too "
    "and call it outside shard_map, which fixes their order. On the raw "
    "path give the probe the shape {raw}.")

PROBE_AXES_ORDER = (
    "gram_haiku: the Gram probe of module '{module}' (shape {shape}) varies "
    "over several mesh axes {axes} inside shard_map. Its rows are split over "
    "all of them, but a probe cannot say in which order, and a guessed order "
    "would permute the Gram's columns.\n"
    "What to do: use gram_haiku.value_grad_and_gram(apply_fn, mesh=mesh, "
    "mesh_axes=...), which builds the shard_map and so fixes the order, or "
    "split the examples over one mesh axis on the raw path.")

MESH_AXES_ORDER = (
    "gram_haiku.{fn}(mesh_axes={axes}): the examples are split over several "
    "mesh axes, inside a jax.shard_map built elsewhere. Its body cannot see "
    "in which order the batch's PartitionSpec entry splits them, and an "
    "order other than {axes} would permute the Gram's columns with no "
    "error.\n"
    "What to do: pass the mesh as well, gram_haiku.{fn}(..., mesh=mesh, "
    "mesh_axes={axes}), and call the result outside shard_map on the whole "
    "batch: it builds the shard_map itself, splitting the examples with "
    "PartitionSpec({axes}) and assembling the Gram in the same order. Or "
    "split the examples over one mesh axis.")

MESH_AXES_NOT_IN_MESH = (
    "gram_haiku.{fn}(mesh=..., mesh_axes={axes}): the mesh has the axes "
    "{names}, not {missing}.\n"
    "What to do: name mesh axes of this mesh (the ones the examples are to "
    "be split over), or leave mesh_axes out to split them over all of them.")

MESH_SCAN_CARRY = (
    "gram_haiku.{fn}(mesh=..., mesh_axes={axes}): the loss runs inside a "
    "jax.shard_map "
    "over {axes}, where the examples, and every value computed from them, "
    "vary over those axes; a lax.scan (hk.dynamic_unroll, hk.scan) whose "
    "carry starts from a value that does not (an RNN's zero initial state) "
    "then returns a carry of another type, which JAX refuses (its error "
    "follows). The untracked model fails the same way under shard_map.\n"
    "What to do: cast the initial carry to varying where the model runs "
    "under the mesh, e.g. state = jax.tree.map(lambda s: jax.lax.pcast(s, "
    "{axes}, to='varying'), core.initial_state(batch_size)).\n"
    "JAX's error: {error}")

MESH_SPLIT_SIZE = (
    "gram_haiku.{fn}(mesh=..., mesh_axes={axes}): a batch array of shape "
    "{shape} has {size} examples along axis {axis}, which {n} "
    "devices cannot share equally.\n"
    "What to do: give a batch whose size is a multiple of {n} (pad it, with "
    "clipped_grad's is_padding_example marking the padding), or split it "
    "over fewer devices.")

MESH_INSIDE_SHARD_MAP = (
    "gram_haiku.{fn}(mesh=...): the function it returns builds its own "
    "jax.shard_map and takes the whole batch, but it was called inside "
    "shard_map or with mesh axes {bound} already bound.\n"
    "What to do: call it outside shard_map (under jax.jit if you like), or "
    "drop mesh= and pass mesh_axes= inside your own shard_map (one mesh "
    "axis).")

PARAM_TRANSFORMED = (
    "gram_haiku: parameter '{leaf}' reaches the tracked layer '{module}' "
    "(its {param!r}) through `{via}`, which changes its values, and that "
    "computation cannot be pulled back here: {why}. The layer's Gram would "
    "be taken with respect to what it receives, not with respect to the "
    "parameter you differentiate, and would be wrong.\n"
    "What to do: a reparametrisation (weight norm, scaling, low-rank "
    "adapters) is exact when the layer is applied outside jax.jit, "
    "hk.remat, hk.cond and loops inside the loss (hk.static_unroll is "
    "fine), every use computes it alike, and the parameter is read by that "
    "layer's getter alone; otherwise apply the layer outside "
    "gram_haiku.track() or write a Gram rule for the whole reparametrised "
    "layer (gram_haiku.Rule). Frozen weights (stop_gradient), casts "
    "(mixed-precision policies), reshapes and hk.layer_stack slices are "
    "supported everywhere.")

RAW_GETTER = (
    "gram_haiku: a custom getter hands the tracked layer '{module}' a new "
    "value of its parameters (a scale, a reparametrisation, stop_gradient, "
    "a copy; anything but the cast of the module's mixed-precision policy). On "
    "the raw jax.grad path nothing says what it computes, so the layer's "
    "Gram would be taken with respect to what it receives, which may not "
    "be the parameter you differentiate.\n"
    "What to do: use gram_haiku.value_grad_and_gram (or reweighted_grad, "
    "clipped_grad): it reads the getter from the traced program and is "
    "exact for frozen and reparametrised weights.")

RAW_MASKED = (
    "gram_haiku: module '{module}' multiplies its weight by its mask "
    "(hk.ConvND/ConvNDTranspose(mask=...)) before the convolution, so the "
    "tracked op receives w * mask, not the parameter w (a custom getter "
    "that changes the values would do the same). On the raw jax.grad path "
    "nothing pulls the layer's per-example gradients back to w, so its Gram "
    "would be taken with respect to w * mask: wrong wherever the mask is "
    "not 0 or 1, and counting the masked entries' gradients.\n"
    "What to do: use gram_haiku.value_grad_and_gram (or reweighted_grad, "
    "clipped_grad): it reads the mask from the traced program and is exact "
    "for masked weights.")

PARTLY_DIFFERENTIATED = (
    "gram_haiku: the Gram of the tracked layer '{module}' is taken, but only "
    "its parameter(s) {wanted} are differentiated, not {others} (frozen: "
    "closed over or read through stop_gradient?). Here nothing says which "
    "parameters train, so the Gram covers them all and would hold the "
    "frozen ones' terms.\n"
    "What to do: use gram_haiku.value_grad_and_gram (or reweighted_grad, "
    "clipped_grad), which reads the frozen parameters from the traced "
    "program and leaves them out, or differentiate every parameter of the "
    "layer.")

FROZEN_IN_SOME_USES = (
    "gram_haiku: the tracked layer '{name}' is applied with different "
    "parameters frozen in different uses ({params}: read through "
    "stop_gradient or not given as parameters in some uses only). Each "
    "use would need its own Gram terms, which one layer name cannot say.\n"
    "What to do: freeze the same parameters in every use of the layer, or "
    "give the uses different module names.")

PARAM_IN_TWO_MODULES = (
    "gram_haiku: parameter '{leaf}' reaches tracked layers of several "
    "modules: {modules}. Each module's Gram covers its own uses only, so the "
    "cross terms between them would be missing and the total Gram would be "
    "wrong.\n"
    "What to do: use one module for the shared weight (tied embeddings: "
    "gram_haiku.unembed(embed, h)), or apply one of the uses outside "
    "gram_haiku.track().")

MIXED_MODES = (
    "gram_haiku: module '{module}' is applied under two track() modes, "
    "{modes}. One module has one Gram (or one diagonal) per pass.\n"
    "What to do: apply the module inside track() contexts of one mode.")

COMPLEX_OPERANDS = (
    "gram_haiku: the tracked layer '{module}' has complex operands "
    "({operands}). Its Gram rules are written for real parameters and "
    "inputs: the per-example gradients of complex parameters need "
    "conjugates that they do not take, so the Gram, the norms and any "
    "clipped gradient would be silently wrong.\n"
    "What to do: give the layer real operands (a complex input or weight "
    "as two real arrays, its real and imaginary parts, e.g. stacked along "
    "the features), or apply the layer outside gram_haiku.track(). "
    "Inference and plain gradients of this model are not affected.")

MODULE_NAME_TWO_LAYERS = (
    "gram_haiku: the module name '{module}' is used by two different tracked "
    "layers: {first} and {second}. They share one Gram probe in hk.State, "
    "which holds one layer's Gram (or per-example gradients), so neither "
    "can be computed right (typically two modules given one name with "
    "hk.experimental.force_name or name_like, or a custom module named "
    "like another).\n"
    "What to do: give each layer its own module name. To share a "
    "parameter between them, share the module itself (call the same "
    "module twice) or read it once and pass it on.")

PROBE_NOT_FROM_STATE = (
    "gram_haiku: the tracked layer '{module}' reads a Gram probe that is "
    "not the probe of the `state` argument being differentiated: {found}. "
    "The Gram is that probe's gradient, so this layer's Gram (and any "
    "clipped or reweighted gradient) would be zero, partial or scaled, "
    "silently wrong.\n"
    "What to do: pass the `state` argument to `f.apply` unchanged (not a "
    "closed-over or stored state, not jax.lax.stop_gradient(state), not "
    "scaled, and not rebuilt from another state's entries). For a nested "
    "hk.transform of tracked layers, lift it into the outer transform "
    "(hk.experimental.lift_with_state) so that its state is the outer "
    "state's, or apply its layers outside gram_haiku.track().")

HIGHER_ORDER = (
    "gram_haiku: the tracked layer '{module}' is differentiated inside the "
    "differentiated function (jax.grad/hk.grad within the loss, e.g. a "
    "gradient penalty), while its Gram probe is differentiated by the outer "
    "transform. The Gram would miss that use's contribution to the "
    "per-example gradients.\n"
    "What to do: compute the inner gradient with a model that is not inside "
    "gram_haiku.track() (apply the same modules outside it), or leave the "
    "penalty out of the loss whose Gram you take.")

FORWARD_MODE_INSIDE = (
    "gram_haiku: the tracked layer '{module}' is differentiated in forward "
    "mode (jax.jvp, jax.linearize or jax.jacfwd) inside the function whose "
    "Gram probes are differentiated (tangent propagation, a Jacobian "
    "penalty). There the layer runs as its plain computation, and the Gram "
    "would miss that use's contribution to the per-example gradients.\n"
    "What to do: compute the forward-mode derivative with a model that is "
    "not inside gram_haiku.track() (apply the same modules outside it), or "
    "leave that term out of the loss whose Gram you take.")

NO_FORWARD_USE = (
    "gram_haiku.value_grad_and_gram: the Haiku state holds Gram probes for "
    "{modules}, but none of those layers is applied in the forward pass of "
    "the loss (they may be used only inside jax.grad/hk.grad within it, or "
    "inside jax.jvp/jax.linearize, where a tracked layer runs as its plain "
    "computation).\n"
    "What to do: apply the tracked layers in the loss itself; the Gram of "
    "a gradient penalty or of a forward-mode derivative (tangent "
    "propagation) is not supported.")

BARE_BATCH_SIZE = (
    "gram_haiku.functional: the batch arguments (shapes {shapes}) do not "
    "have one example size (sizes {sizes} along their example axes), so "
    "the examples could not be followed through the loss.\n"
    "What to do: pass example_axes=, one entry per batch argument: the "
    "axis of its examples (an int), or None for an argument that holds no "
    "examples (e.g. a table every example reads).")

EMPTY_BATCH_NO_LAYERS = (
    "gram_haiku.value_grad_and_gram: the batch is empty (inputs {shapes}) "
    "and no tracked layer is left in the traced loss: with no examples the "
    "loss does not depend on them (a gather of an empty batch's labels, as "
    "after gram_haiku.unembed, leaves nothing to differentiate). Every "
    "per-example gradient, Gram and clipped sum of an empty batch is zero.\n"
    "What to do: skip the step when x.shape[0] == 0 (the shape is static, "
    "so a Python if works under jit), or use zero gradients for it.")

SHARED_NAME_CLASH = (
    "gram_haiku: the layer name '{name}' belongs to modules whose parameters "
    "are used more than once ({shared}) and to modules whose are not "
    "({unshared}), in nested Haiku transforms (hk.layer_stack). Inside them "
    "a layer sees only its own name, so the two cannot be told apart.\n"
    "What to do: give the modules distinct names (hk.Linear(..., "
    "name=...)).")

_LOOP_OVER_EXAMPLES = (
    "A loop over the examples (hk.scan, hk.map or hk.fori_loop over the "
    "batch, or a Python loop applying the layer to one example at a time) "
    "ends here too: map the per-example code with hk.vmap instead, which "
    "is exact.")

EXAMPLE_AXIS_NOT_EXAMPLES = (
    "gram_haiku: the tracked layer '{module}' takes axis {position} of its "
    "input (shape {shape}, as the layer sees it: inside a vmap, without the "
    "vmapped axes) as the example axis, but in the traced program "
    "that input {found}. Its Gram would be over the wrong axis (a sequence, "
    "positions, an unbatched memory), silently wrong.\n"
    "What to do: if the layer runs inside a vmap over something other than "
    "the examples (heads, positions, set elements), use "
    "gram_haiku.track(example_axis=0) to take the explicit batch axis "
    "(track(example_axis='<axis_name>') for a named vmap over the "
    "examples). Otherwise give the layer its input with the examples along "
    "that axis (broadcast shared inputs such as positions to the batch: "
    "jnp.broadcast_to(pos, (B,) + pos.shape), or apply the layer inside "
    "per-example code under hk.vmap over the examples, where such layers "
    "are exact; keep sequences batch-major), or apply the layer outside "
    "gram_haiku.track(). " + _LOOP_OVER_EXAMPLES)

EXAMPLES_NOT_FOLLOWED = (
    "gram_haiku: the examples could not be followed through the traced "
    "program to {where}: they pass through {primitives}, which the example "
    "flow analysis does not model. If that mixes or reorders the examples "
    "(a scatter or dynamic_update_slice along the batch, an FFT or solve "
    "over it, a custom_vjp whose backward mixes rows), the Gram is wrong.\n"
    "What to do: run gram_haiku.verify(...) once on this model with a real "
    "batch; if the operation acts within each example only, this warning "
    "can be ignored (warnings.filterwarnings('ignore', "
    "category=gram_haiku.ExampleFlowWarning)).")

EXAMPLES_NOT_FOLLOWED_PRIVACY = (
    " A privacy guarantee cannot rest on an unchecked flow, so clipping "
    "refuses it: write that operation with primitives that act within each "
    "example (or outside the differentiated function).")

EXAMPLES_MERGED = (
    "gram_haiku: the tracked layer '{module}' takes axis {position} of its "
    "input (shape {shape}) as the example axis, but that axis merges the "
    "examples with other positions ({inner} per example inside, {outer} "
    "outside), e.g. a (B, T, F) -> (B*T, F) reshape as hk.BatchApply makes: "
    "its Gram would be of positions, not of examples.\n"
    "What to do: apply the layer to the unmerged input (hk.Linear and the "
    "other tracked layers accept any leading axes: (B, T, F) needs no "
    "reshape), or hk.vmap over the examples.")

EXAMPLES_COUPLED = (
    "gram_haiku: the input of the tracked layer '{module}' (shape {shape}) "
    "depends on several examples at once (a statistic over the batch, a "
    "softmax over the batch, rows reordered or subset). Per-example "
    "gradients are not defined when examples are coupled, so no Gram is.\n"
    "What to do: compute the batch statistic outside the differentiated "
    "function, or wrap it in jax.lax.stop_gradient (a constant for "
    "differentiation, as input data are: each example's gradient is then "
    "that of its own row, the statistic held fixed), or apply the coupled "
    "part outside gram_haiku.track().")

LOSS_COUPLED = (
    "gram_haiku: the loss is not a sum (or mean) of "
    "per-example terms: it combines the examples nonlinearly (a softmax or "
    "logsumexp over the batch, a contrastive loss, a function of a batch "
    "sum). Per-example gradients, and so the Gram, are not defined. The "
    "examples, with the parameters' values, were first combined by "
    "{primitive} (operands {shapes}){line}.\n"
    "What to do: write the loss as a sum of per-example losses, or compute "
    "the coupled part outside the differentiated function. If it is a sum "
    "of per-example terms written in a way this check cannot follow (the "
    "Gram of the outputs: jnp.trace(out @ out.T); a reshape that moves the "
    "examples off axis 0, applied alike to outputs and labels; a "
    "convolution of the losses; a batch-wide term added to every example's "
    "loss before the sum, (l + jnp.mean(out ** 2)).sum()), write each "
    "example's term out: jnp.sum(out * out), the same on the unreshaped "
    "arrays, or l.sum() + B * jnp.mean(out ** 2). A weight that "
    "is computed from the batch but must not be differentiated (a "
    "normaliser, a batch softmax of the losses) goes in "
    "jax.lax.stop_gradient: the loss is then a weighted sum of per-example "
    "terms, and the Gram is of the weighted terms. If the examples are not "
    "along axis 0 of the inputs (a time-major [T, B, ...] sequence, whose "
    "recurrence couples the rows of axis 0), say where they are with "
    "example_axes= (one entry per input, e.g. example_axes=(1, 1)).")

PROBE_LINEARIZED = (
    "gram_haiku: the Gram probe of module '{module}' is linearized in "
    "forward mode (jax.linearize, jax.jvp or jax.jacfwd with respect to the "
    "Haiku state). The Gram exists only as the probe's cotangent, in reverse "
    "mode.\n"
    "What to do: linearize with respect to the parameters only, and take "
    "the Gram with gram_haiku.value_grad_and_gram (or jax.grad with respect "
    "to the probes).")

EXAMPLES_REORDERED = (
    "gram_haiku: the input of the tracked layer '{module}' (shape {shape}) "
    "holds the examples reordered, repeated or a subset of them (a slice, a "
    "reversal or rows picked by index along the example axis). Its Gram "
    "would not line up with the other layers' Grams, row for row.\n"
    "What to do: apply the layer to the examples in the batch's order (move "
    "the reordering after it, or into the loss), or apply it outside "
    "gram_haiku.track(). To pick one position per example, use "
    "jnp.take_along_axis(h, idx[:, None, None], axis=1), which keeps each "
    "example's row, rather than h[jnp.arange(B), idx]. " + _LOOP_OVER_EXAMPLES)

EXAMPLES_SUBSET = (
    "gram_haiku: the tracked layer '{module}' (input shape {shape}) is "
    "applied to {size} of the batch's {batch} examples at a time (the batch "
    "split, or one example per call). A Gram op needs every example of the "
    "batch in one application.\n"
    "What to do: apply the layer to the whole batch (hk.vmap for "
    "per-example code), or apply it outside gram_haiku.track().")

REWEIGHT_UNTRACKED = (
    "gram_haiku.{fn}: parameter(s) {params} are trainable but no Gram rule "
    "covers them ({why}), so their per-example gradients are unknown and "
    "sum_i c_i g_i cannot be formed for them{privacy}.\n"
    "What to do: run their modules inside gram_haiku.track() with a "
    "supported layer (or write a rule: gram_haiku.Rule + "
    "gram_haiku.register_layer), or declare them frozen (frozen=...) to give "
    "them a zero gradient.")

WEIGHTS_SHAPE = (
    "gram_haiku.reweighted_grad: weight_fn returned {got}, expected one "
    "weight per example: shape ({size},) (this device's examples under "
    "shard_map), a float dtype.\n"
    "What to do: return a (B,) vector, e.g. jnp.minimum(1, C / grams.norms).")

PER_LAYER_THRESHOLDS = (
    "gram_haiku.{fn}(clipping='per-layer'): {problem}. Tracked "
    "modules: {modules}.\n"
    "What to do: pass l2_clip_norm as one number C (split over the layers "
    "by layer_split: 'equal', C / sqrt(L) each, 'by_size', or a function "
    "{{module: number of parameters}} -> {{module: weight}}), or a dict with a "
    "positive threshold for every tracked module and for no other.")

NEEDS_JAX_PRIVACY = (
    "gram_haiku.clipped_grad returns jax-privacy's BoundedSensitivityCallable, "
    "and jax-privacy is not installed ({error}).\n"
    "What to do: pip install 'gram_haiku[dp]' (in a checkout: pip "
    "install '.[dp]') (jax-privacy and "
    "dp-accounting).")

REORDERED_ROWS_MEET_DATA = (
    "gram_haiku: the loss takes rows of the tracked layers' outputs out of "
    "the batch's order (a reversal, a roll, rows picked by index along the "
    "example axis) and then combines them with input data whose rows are "
    "in another order, or in one the program does not show to be the same "
    "(rows picked by index arrays computed in the program) ({primitive} of "
    "shapes {shapes}{line}): "
    "each term then pairs one example's outputs with another example's "
    "data, so which example its gradient belongs to is not defined, and no "
    "per-example Gram lines up with the batch.\n"
    "What to do: reorder the data the same way by slices or flips "
    "(out[::-1] with y[::-1]), or keep the outputs in the batch's order "
    "and reorder the data instead (the Gram is then over the rows of the "
    "model's inputs).")

DATA_COUPLED = (
    "gram_haiku.clipped_grad: an example's loss reads data of other "
    "examples ({state}: e.g. a batch mean of the labels or inputs, or rows "
    "of another example; it meets the parameters' values in {where}). Its "
    "gradient then depends on other examples' "
    "data, and clipping it does not bound one example's influence: the "
    "privacy guarantee would silently break.\n"
    "What to do: compute each example's loss from its own row only (a "
    "normalisation with fixed, data-independent statistics is fine).")

LOOPED_OVER_EXAMPLES = (
    "\nHere the examples are the steps of a loop (jax.lax.map, hk.map or a "
    "scan over the batch, one example per step), which this check cannot "
    "tell from a loop that mixes them: map over the examples with jax.vmap "
    "(hk.vmap in Haiku code) instead, which is followed exactly.")

BAD_EXAMPLE_AXES = (
    "gram_haiku: example_axes={got!r} does not match the batch: it needs one "
    "entry per positional batch argument ({n} given after rng), each an int "
    "(the axis of that argument's arrays that holds the examples) or None "
    "(the argument holds no examples, e.g. a memory every example reads).\n"
    "What to do: pass a tuple of {n} ints or Nones, e.g. example_axes=(1, 0) "
    "for a time-major input and batch-major labels.")

EXAMPLE_AXIS_OUT_OF_RANGE = (
    "gram_haiku: example_axes gives axis {axis} for batch argument {k}, but "
    "an array of that argument has shape {shape}.\n"
    "What to do: give an axis of every array in that argument, or None.")

EXAMPLE_AXIS_SIZE = (
    "gram_haiku: example_axes says that axis {axis} of a batch array of "
    "shape {shape} holds the examples, but it has {size} entries and the "
    "tracked layers see {batch} examples.\n"
    "What to do: give the axis that holds the examples (or None for an "
    "array that holds none).")

PADDING_MASK_DTYPE = (
    "gram_haiku.clipped_grad: is_padding_example must be a boolean array "
    "(True for a padded row), got dtype {dtype}.\n"
    "What to do: pass a bool[B] mask, e.g. jnp.arange(B) >= num_real; to "
    "weight examples, use gram_haiku.reweighted_grad.")

PADDING_MASK_SHAPE = (
    "gram_haiku.clipped_grad: is_padding_example has shape {shape}, but "
    "the tracked layers see {size} examples (inside shard_map: this "
    "device's).\n"
    "What to do: pass one bool per example, shape ({size},), split over the "
    "mesh like the batch (in_specs).")

LOSS_IS_A_TUPLE = (
    "gram_haiku: the transformed function returns a tuple of {n} values, "
    "not a scalar loss.\n"
    "What to do: for (loss, aux) pass has_aux=True (value_grad_and_gram, "
    "reweighted_grad, clipped_grad and verify all take it), or return the "
    "loss alone.")

RAW_PARAM_OUTSIDE_OP = (
    "gram_haiku: module '{module}' holds parameters that its layer handler "
    "does not give to its Gram op (it applies them outside the op, e.g. "
    "s * op(x, w) or op(x + b, w)). On the raw jax.grad path nothing reads "
    "that use, so the Gram would miss their per-example gradients.\n"
    "What to do: give every parameter of the module to the op (call.apply("
    "op, x, (w, s))), or use gram_haiku.value_grad_and_gram, which follows "
    "such uses in the traced program.")

CLOSED_OVER_BATCH_DATA = (
    "gram_haiku.clipped_grad: the loss reads an array it closes over (not "
    "an argument of apply) whose shape has the batch's size {batch} along "
    "some axis (closed-over arrays of shapes {shapes}: NumPy or JAX arrays "
    "captured by the function, or values of an enclosing jax.jit such as a "
    "train step's labels), and that array meets the examples' values or "
    "the parameters' values in {where}. Which of its rows belongs to which "
    "example the program does not say, so each example's gradient may read "
    "other examples' data (labels centred by their batch mean, inputs in "
    "another order), and clipping it would not bound one example's "
    "influence: the privacy guarantee could silently break.\n"
    "What to do: pass the array as an argument of apply, e.g. "
    "f = hk.transform_with_state(lambda x, y: loss(net(x), y)) called as "
    "clipped(params, state, rng, x, y), rather than closing over y; if its "
    "examples are not along axis 0, say where with example_axes= (one "
    "entry per argument, e.g. example_axes=(0, 1)); an argument that holds "
    "no examples (a fixed table that merely has {batch} rows) gets None in "
    "example_axes. Constants without an axis of the batch's size (a "
    "weight-decay scalar, a fixed projection) may stay closed over.")

LOOP_TRIP_COUPLED = (
    " The data went through a while_loop (or a fori_loop with a bound "
    "computed in the program: {where}) whose number of rounds depends on "
    "several examples' data "
    "or on values this analysis cannot show to be one example's (its "
    "condition reads a batch-wide reduction, one example's entry, or a "
    "count over the batch): every value it carries then depends on every "
    "example. What to do: make the number of rounds fixed (lax.fori_loop "
    "with Python int bounds, lax.scan), or decide it per example under "
    "jax.vmap (a vmapped while_loop stops each example on its own "
    "condition).")

BATCH_SIZE_UNKNOWN = (
    "gram_haiku.clipped_grad: the batch size cannot be told from the "
    "arguments of apply (the leading sizes of the batch arguments after "
    "rng: {leading}; the tracked layers' example axes: {sizes}), so the "
    "check that each example's gradient reads its own data only cannot "
    "run, and a privacy guarantee cannot rest on an unchecked flow.\n"
    "What to do: pass the data as arguments of apply (not closed over), "
    "and say where each argument's examples are with example_axes= (one "
    "entry per argument after rng: the axis that holds the examples, or "
    "None for an argument without examples).")

# -- Inference, lifted transforms and the arguments of apply ---------------

PARAM_NOT_FLOAT = (
    "gram_haiku: parameter leaf {names} of the params argument has dtype "
    "{dtypes}; gradients, hence per-example gradients and their Gram, are "
    "defined for floating-point parameters only (jax.grad refuses it too).\n"
    "What to do: keep integer and boolean values out of params: pass them "
    "as a batch argument (example_axes=None for one that holds no "
    "examples), close over them (functools.partial), or keep them in the "
    "Haiku state.")

STATE_IS_NONE = (
    "gram_haiku: the state argument is None, but the Gram probes live in "
    "the Haiku state (a 'gram_probe' entry per tracked module), so there is "
    "nothing to differentiate.\n"
    "What to do: transform the loss with hk.transform_with_state and pass "
    "the state its init returns, in the order of f.apply: `params, state = "
    "f.init(rng, *batch)`, then `gram_haiku.value_grad_and_gram(f.apply)"
    "(params, state, rng, *batch)`.")

def describe(value) -> str:
  """What a user passed, for a message: ``"an array float32[3, 4]"`` for an
  array (concrete or traced: the same words under ``jit``), else ``"a"``
  and its type's name."""
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return f"an array {value.dtype}{list(value.shape)}"
  return f"a {type(value).__name__}"


STATE_NOT_A_MAPPING = (
    "gram_haiku: the state argument (the second of (params, state, rng, "
    "*batch)) is {what}, not the Haiku state mapping that holds the Gram "
    "probes.\n"
    "What to do: pass the arguments in the order of f.apply of "
    "hk.transform_with_state: `(params, state, rng, *batch)`, with `params, "
    "state = f.init(rng, *batch)`.")

PARAMS_STATE_SWAPPED = (
    "gram_haiku: the first argument holds the Gram probes ('gram_probe' "
    "entries of {modules}) and the second holds none: params and state look "
    "swapped.\n"
    "What to do: pass them in the order of f.apply: `(params, state, rng, "
    "*batch)`, as `params, state = f.init(rng, *batch)` returns them.")

PURE_TRANSFORM_APPLY = (
    "gram_haiku: apply_fn is the apply of hk.transform (or hk.without_state),"
    " which takes and returns no Haiku state; the Gram probes of the tracked "
    "modules live in the state.\n"
    "What to do: transform the loss with hk.transform_with_state, and pass "
    "its apply and the state from its init: `f = hk.transform_with_state"
    "(loss_fn); params, state = f.init(rng, *batch); "
    "gram_haiku.value_grad_and_gram(f.apply)(params, state, rng, *batch)`.")

TRACK_IN_PURE_TRANSFORM = (
    "gram_haiku.track(): module {module!r} keeps its Gram probe in hk.State, "
    "but it runs inside hk.transform (or hk.without_state), which has no "
    "state (Haiku would raise NonEmptyStateError about hk.get_state, which "
    "your code need not call: the state is gram_haiku's probes).\n"
    "What to do: transform the function that enters `with "
    "gram_haiku.track():` with hk.transform_with_state, and pass the state "
    "from its init to apply (`params, state = f.init(rng, *batch)`; "
    "`f.apply(params, state, rng, *batch)`).")

TRACK_IN_LIFTED_PURE_TRANSFORM = (
    "gram_haiku.track(): module {module!r} runs inside an inner "
    "hk.transform (or hk.without_state) called within the outer transform, "
    "e.g. lifted with hk.lift or hk.experimental.transparent_lift. Its Gram "
    "probe lives in hk.State, which a pure transform has not (Haiku would "
    "raise NonEmptyStateError about hk.get_state, which your code need not "
    "call: the state is gram_haiku's probes).\n"
    "What to do: transform the inner function with hk.transform_with_state "
    "and lift it with its state: `init, updater = hk.lift_with_state("
    "inner.init, name='inner')` (or hk.experimental."
    "transparent_lift_with_state); `params, state = init(rng, x)`; `out, "
    "state = inner.apply(params, state, None, x)`; `updater.update(state)`. "
    "The probes then reach the outer state and its Grams. Or apply the inner "
    "model outside gram_haiku.track() (its parameters are then untracked).")

FROZEN_NAME_CLASH = (
    "gram_haiku: two different tracked modules, {first!r} (frozen: "
    "{first_frozen}) and {second!r} (frozen: {second_frozen}), are both "
    "named '{name}' where they run: one sits inside a nested Haiku "
    "transform (hk.layer_stack, hk.lift), where a layer sees only its own "
    "name, not the prefix of its parameters. Their frozen= parameters "
    "differ, and the pass plans each layer by that name, so it cannot "
    "freeze one and train the other.\n"
    "What to do: give the modules distinct names (e.g. hk.Linear(..., "
    "name='head') for the one outside the stack), or freeze the same "
    "parameters of both.")

MEAN_LOSS_CLIPPED = (
    "gram_haiku.{fn}: the loss looks like a mean over the {batch} examples "
    "(a sum over the batch divided by a multiple of {batch}, e.g. "
    "jnp.mean). Each example's gradient is then g_i / {batch}, so the clip "
    "norm acts as {batch} times l2_clip_norm on the real per-example "
    "gradients (jax-privacy, which evaluates one example at a time, sees "
    "g_i: the clipped sums differ). Each example still moves the sum by at "
    "most l2_clip_norm, but only while the divisor does not depend on the "
    "data: a mean over a Poisson-sampled batch's actual size changes every "
    "example's term when one is added or removed.\n"
    "What to do: return the sum of the per-example losses (`.sum()`, not "
    "`.mean()`), and divide the clipped sum by the batch size afterwards "
    "with normalize_by= (e.g. the expected batch size). If the division is "
    "meant, silence this with warnings.filterwarnings('ignore', "
    "message='gram_haiku.{fn}: the loss looks like a mean').")

PENALTY_ON_PARAMETERS = (
    " If that use is a penalty on the weights (weight decay "
    "lam * sum(w ** 2), an L1 norm of the parameters): it reads no "
    "example's data, so it is no part of any example's gradient. Leave it "
    "out of the loss and use the optimizer's weight decay "
    "(optax.add_decayed_weights, optax.adamw), or add its gradient (for "
    "lam * sum(w ** 2): 2 * lam * w) to the clipped sum or the Gram's "
    "gradient outside the tracked loss: it needs no clipping and adds no "
    "privacy cost.")

VIEWS_SPLIT_BY_RESHAPE = (
    " A reshape split the examples' axis of {n} rows into ({b}, {k})"
    "{where}. If these are {b} examples with {k} rows each "
    "(augmentation multiplicity, several views of one example), give the "
    "tracked layers their input as ({b}, {k}, ...) (x.reshape({b}, {k}, -1) "
    "before them; they accept any leading axes): the examples are then the "
    "{b} rows of axis 0, each one's views summed in its gradient, and "
    "out against y[:, None] is a sum of per-example terms. Taken as {n} "
    "examples, each view would be clipped on its own, and one example "
    "could move a clipped sum by {k} times the clip norm.")

EXAMPLE_AXES_THAT_FIT = (
    " The examples were followed from axis 0 of every batch argument (the "
    "default rule, which cannot tell a time-major (T, B, ...) input from a "
    "batch-major one when T == B). Taken from example_axes={axes!r} "
    "instead (one entry per argument after rng) they reach every tracked "
    "layer's example axis and the loss as per-example terms: if that is "
    "where the examples are (a named hk.vmap(..., in_axes=1, "
    "axis_name=...) over them says so), pass example_axes={axes!r}.")

# -- jax-privacy's clipped_grad options that gram_haiku cannot honour --------
# (gram_haiku.clipped_grad takes jax_privacy.clipping.clipped_grad's
# arguments; each of these names what to use instead.)

JAXP_ARGNUMS = (
    "gram_haiku.clipped_grad: argnums={argnums!r}. fun is the apply of "
    "hk.transform_with_state(f), called fun(params, state, rng, *batch), and "
    "the gradient is taken with respect to params, argument 0.\n"
    "What to do: leave argnums out (or pass 0); to freeze some parameters "
    "pass frozen=, to differentiate an input make it a parameter of a "
    "tracked module.")

JAXP_BATCH_ARGNUMS = (
    "gram_haiku.clipped_grad: batch_argnums={batch_argnums!r}: {problem}. fun "
    "is called fun(params, state, rng, *batch): the examples can only be in "
    "the arguments after rng, numbers 3 and up (jax-privacy's default "
    "batch_argnums=1 would be Haiku's state).\n"
    "What to do: leave batch_argnums out (every argument after rng holds "
    "examples on axis 0, where its leading size is the batch's), or pass "
    "the numbers of the batch arguments, e.g. batch_argnums=(3, 4) for "
    "fun(params, state, rng, x, y).")

JAXP_BATCH_ARGS = (
    "gram_haiku.clipped_grad: {problem}.\n"
    "What to do: pass every argument named in batch_argnums, each with the "
    "examples on axis 0 and the same number of them.")

JAXP_KEEP_BATCH_DIM = (
    "gram_haiku.clipped_grad: keep_batch_dim=False (fun written for one "
    "example, or clipping per user/group over an extra axis) cannot be "
    "honoured: gram_haiku calls fun once on the whole batch and clips each "
    "row of axis 0 of the batch arguments, which fun must accept as a batch "
    "(jax-privacy's keep_batch_dim=True: the same per-example gradients).\n"
    "What to do: write fun for a batch and return the sum of the "
    "per-example losses. Per-group clipping (one clip per user over several "
    "examples) is not supported.")

JAXP_PRE_CLIPPING_TRANSFORM = (
    "gram_haiku.clipped_grad: pre_clipping_transform cannot be honoured: "
    "the per-example gradients are never formed (each example's norm comes "
    "from the Gram of the one backward pass), so there is no per-example "
    "gradient to transform before clipping.\n"
    "What to do: leave it out. To give layers different weights in the "
    "clip, clip per layer: clipping='per-layer' with a dict {module: C_l} "
    "or layer_split= ('equal', 'by_size' or a function).")

JAXP_MICROBATCH_SIZE = (
    "gram_haiku.clipped_grad: microbatch_size={size!r}. It exists to bound "
    "the memory of vmapped per-example gradients, which gram_haiku never "
    "forms: the clipped sum costs one backward pass over the whole batch "
    "(memory close to a plain step's).\n"
    "What to do: leave microbatch_size out. If even a plain step does not "
    "fit, split the batch yourself and add the clipped sums (each call's "
    "sensitivity is per example, so the sum's bound is the same).")

JAXP_PRNG_ARGNUM = (
    "gram_haiku.clipped_grad: prng_argnum={argnum!r} cannot be honoured "
    "exactly: jax-privacy splits that key into one key per example and "
    "vmaps fun, while gram_haiku calls fun once on the whole batch with the "
    "one rng of fun(params, state, rng, *batch) (argument 2), so random "
    "draws (dropout) would differ from jax-privacy's.\n"
    "What to do: leave prng_argnum out and pass the key as rng: "
    "hk.next_rng_key() inside f draws batch-shaped randomness from it (each "
    "example's rows of a dropout mask are independent draws).")

JAXP_SPMD_AXIS_NAME = (
    "gram_haiku.clipped_grad: spmd_axis_name={name!r} (jax.vmap's sharding "
    "of the per-example axis) has no counterpart: no per-example vmap "
    "runs. The examples are split over devices by mesh_axes= (inside your "
    "shard_map) or mesh= (clipped_grad builds the shard_map).\n"
    "What to do: drop spmd_axis_name and pass mesh_axes={name!r} inside "
    "shard_map, or mesh=your_mesh outside it.")

JAXP_RESCALE = (
    "gram_haiku.clipped_grad: rescale_to_unit_norm=True with "
    "l2_clip_norm={c!r}: the clipped sum is divided by l2_clip_norm "
    "(normalize_by=l2_clip_norm does the same), which needs a positive, "
    "finite l2_clip_norm.\n"
    "What to do: pass a positive, finite l2_clip_norm (or leave "
    "rescale_to_unit_norm out and pass normalize_by=C). For each example "
    "scaled to unit norm (jax-privacy's limit l2_clip_norm -> 0), use "
    "clip_fn='automatic': C / (|g_i| + gamma).")

JAXP_TRACED_PER_LAYER = (
    "gram_haiku.clipped_grad: a traced l2_clip_norm with "
    "clipping='per-layer'. Per-layer thresholds are applied inside each "
    "layer's backward rule and are fixed when the step is built.\n"
    "What to do: pass a number (each value compiles its own step), or use "
    "clipping='all-layer', which takes a traced l2_clip_norm under jit.")

JAXP_FULL_AUX_WITH = (
    "gram_haiku.clipped_grad: full_aux=True (also the earlier form "
    "clipped_grad(apply, C), the clip norm passed positionally) returns "
    "(grads, ClippedGradAux), whose fields are the whole batch's value and "
    "aux and the per-example grad_norms; {given} ask for jax-privacy's "
    "AuxiliaryOutput instead.\n"
    "What to do: pass either full_aux=True or "
    "return_values=/return_grad_norms= with l2_clip_norm=C by keyword, not "
    "both.")

GETTER_NOT_BOUNDED = (
    "gram_haiku.clipped_grad: module {module!r} reads its parameters "
    "through a custom getter (or an apply wrapper) whose VJP uses {why}, "
    "which the clipping bound cannot bound: each example's norm is taken "
    "from its stored gradient pulled back through that VJP, and a sound "
    "upper bound of the true norm needs the VJP's operator norm, read "
    "equation by equation (gram_haiku/_src/analysis/linear_bound.py has a rule for "
    "casts, reshapes, sums, broadcasts, products and quotients by values "
    "of the parameters, dot products, concatenation, zero padding, "
    "select and cumsum), and a VJP linear in the cotangent.\n"
    "What to do: write the getter with those operations (a custom VJP "
    "rule must be linear in its cotangent), or freeze the parameters it "
    "reads (frozen=...); gram_haiku.value_grad_and_gram, which needs no "
    "bound, still gives this module's Gram.")

CLIPPED_GRAD_ARGUMENTS = (
    "gram_haiku.clipped_grad: the step was called with {n} positional "
    "argument(s); it takes those of the tracked model's apply, `(params, "
    "state, rng, *batch)` (f.apply of hk.transform_with_state; jax-privacy's "
    "`fun(params, batch)` becomes `f.apply(params, state, rng, *batch)` with "
    "the model built inside gram_haiku.track()).\n"
    "What to do: call it as `step(params, state, rng, *batch)` with `params, "
    "state = f.init(rng, *batch)` (rng may be None).")

GETTER_NOT_LINEAR = (
    "gram_haiku: module {module!r} reads its parameters through a custom "
    "getter (or an apply wrapper) whose VJP is not linear in its cotangent "
    "(it uses {why}; e.g. a custom VJP rule that clips or squashes the "
    "gradient). Each example's gradient is that VJP of its own cotangent, "
    "and a weighted sum of them is not the VJP of the weighted sum, which "
    "is what one pass forms.\n"
    "What to do: make the custom VJP rule linear in its cotangent (clip "
    "the summed gradient afterwards instead), or freeze the parameters it "
    "reads (frozen=...); gram_haiku.value_grad_and_gram still gives this "
    "module's Gram, whose per-example gradients are exact.")

JAXP_SHARED_ARGUMENT = (
    "gram_haiku.clipped_grad: argument {i} is not in batch_argnums, but its "
    "axis 0 has the batch's size, {b}. jax-privacy gives it whole to each "
    "example's call (a batch of one), while here fun sees the whole batch "
    "at once, so wherever the model pairs its rows with the examples' rows "
    "(broadcasting (B, ...) against (B, ...)), row i would meet example i "
    "only: the gradients would be those of another loss, with no error.\n"
    "What to do: if it holds one row per example, add {i} to "
    "batch_argnums; if it is data every example reads, pass it with a "
    "leading axis of 1 (`arg[None]`) and write the model so that it "
    "broadcasts that axis over the examples.")

NTK_BAD_AXES = (
    "gram_haiku.empirical_ntk: {what} = {axes} do not name distinct axes of "
    "the model's output, which has rank {ndim} (axis 0 the examples; "
    "negative axes count from the end), or name one axis as both traced and "
    "diagonal.\n"
    "What to do: give each output axis at most once, in range(-{ndim}, "
    "{ndim}); e.g. trace_axes=(-1,) sums over the logits, trace_axes=() "
    "keeps every pair of outputs, diagonal_axes=(0,) keeps each example "
    "with itself only.")

NTK_PAIRED_BATCH = (
    "gram_haiku.empirical_ntk: {what} includes the example axis 0, "
    "which pairs example i of x1 with example i of x2, but x1 has {n1} "
    "examples and x2 {n2}.\n"
    "What to do: give x2 as many examples as x1 (or x2=None for x1 with "
    "itself), or leave 0 out of {what} for the full x1 x x2 kernel.")

NTK_BAD_BATCH = (
    "gram_haiku.empirical_ntk: every leaf of {name} must have the examples "
    "on axis 0, with one size; got leaf shapes {shapes}.\n"
    "What to do: pass the inputs as arrays (or a pytree of arrays) whose "
    "axis 0 is the examples, one size for all of them.")

NTK_X2_MISMATCH = (
    "gram_haiku.empirical_ntk: x2 must have x1's structure and dtypes (it "
    "is appended to x1 and runs through the model with it); got x1 leaves "
    "{x1} and x2 leaves {x2}. A float32 x2 would promote a bfloat16 x1, a "
    "kernel of another model than the one at x1.\n"
    "What to do: cast x2 to x1's dtypes (jax.tree.map(lambda b, a: "
    "b.astype(a.dtype), x2, x1)).")

NTK_UNTRACKED = (
    "gram_haiku.empirical_ntk: the parameters {names} are read outside every "
    "tracked layer, so their part of each output's gradient, and of the "
    "kernel, would be missing.\n"
    "What to do: create them inside a tracked Haiku module (gram_haiku.track "
    "covers hk.Linear, hk.Conv*, hk.Embed, hk.LayerNorm, ...: see "
    "'Supported layers' in docs/layers.rst; a bare parameter broadcast over "
    "the examples, such as learned positions or a scale, is covered where "
    "it is used: see 'Coverage' in docs/semantics.rst), or write a Gram rule "
    "for their layer (gram_haiku.Rule with gram_haiku.register_layer).")

MEAN_LOSS_CROSS = (
    "gram_haiku.{fn}: the loss looks like a mean over the {batch} examples "
    "(a sum over the batch divided by a multiple of {batch}, e.g. "
    "jnp.mean). cross_gram evaluates the training examples and the queries "
    "as one batch of {batch}, so a mean divides every example's gradient, "
    "and the training update, by {batch} instead of by the number of "
    "training examples: the update and the blocks would both be scaled.\n"
    "What to do: return the sum of the per-example losses (`.sum()`, not "
    "`.mean()`), and scale the gradient and the blocks afterwards (divide "
    "the gradient by B, the blocks by B * V for a mean over each set).")

CROSS_QUERIES = (
    "gram_haiku.cross_gram: queries= must be a tuple with one query "
    "argument per positional argument of the step ({n}), got {got}.\n"
    "What to do: pass queries=(x_query, y_query) for a step called as "
    "fn(params, state, rng, x, y, queries=...).")

CROSS_QUERY_SHAPES = (
    "gram_haiku.cross_gram: argument {k} and its queries differ in "
    "structure or in shape off the example axis {axis}: argument leaves "
    "{args}, query leaves {queries}.\n"
    "What to do: give the queries the arguments' structure and shapes, with "
    "their own number of examples on the example axis (or mark a shared, "
    "not per-example, argument None in example_axes).")

CROSS_QUERY_DTYPES = (
    "gram_haiku.cross_gram: argument {k} and its queries differ in dtype: "
    "argument leaves {args}, query leaves {queries}. Appended to the "
    "training rows, the queries would promote them (a bfloat16 batch run "
    "in float32 gives a Gram of another model than the one you train).\n"
    "What to do: cast the queries to the arguments' dtypes (e.g. "
    "jax.tree.map(lambda q, a: q.astype(a.dtype), queries, args)).")

CROSS_QUERY_FLAG = (
    "gram_haiku.cross_gram: query_flag={got}: query_flag names the keyword "
    "argument of the loss that tells the query rows from the training rows "
    "(a bool[B + V] array), so it must be a Python identifier.\n"
    "What to do: pass query_flag='is_query' and give the function inside "
    "hk.transform_with_state a keyword argument is_query=None that selects "
    "the query loss on the rows where it is True.")

CROSS_CLIPPING = (
    "gram_haiku.cross_gram: clipping={got}: expected one of {options}, "
    "as in clipped_grad.\n"
    "What to do: clipping='all-layer' with one number l2_clip_norm (the "
    "global norm), or clipping='per-layer' with one number (split over the "
    "tracked modules by layer_split) or a dict {{module: threshold}}.")

CROSS_QUERY_FLAG_GIVEN = (
    "gram_haiku.cross_gram(query_flag={name!r}): the step was called with "
    "{name}= itself, but cross_gram sets that keyword argument of the loss "
    "(bool[B + V], True on the query rows) and would overwrite it.\n"
    "What to do: leave {name}= out of the call, or name another keyword "
    "with query_flag=.")

CROSS_SIZES = (
    "gram_haiku.cross_gram: the arguments and queries hold (training, "
    "query) example counts {sizes}; one B and one V are needed.\n"
    "What to do: give every per-example argument the same number of "
    "training examples, and every query argument the same number of "
    "queries (mark a shared argument None in example_axes).")

# -- program-level Gram rules (gram_haiku._src.analysis.program_rules) ---------

#: The tail of UNTRACKED_PARAM (and of REWEIGHT_UNTRACKED's reasons) for a
#: parameter whose use no program-level rule covers: where and why.
PROGRAM_TRACES_DIFFER = (
    "gram_haiku: parameter(s) {params} are read outside every tracked "
    "layer's parameters, and the program that reads them is not the same "
    "in the traced loss and in the pass: tracked layers run under a "
    "transform that sees them as their plain computation (jax.grad, "
    "jax.jvp or jax.linearize of the model inside the loss, as in a "
    "gradient penalty or tangent propagation), whose share of each "
    "example's gradient the pass cannot follow.\n"
    "What to do: compute that term outside the loss given to gram_haiku, "
    "or with a copy of the model outside gram_haiku.track() whose "
    "parameters are separate (and frozen= where they need no gradient).")

PROGRAM_REFUSED = (
    " No program-level rule covers its use by {where}: {why}.")

PROGRAM_NO_RULE = (
    "a value computed from the parameter alone meets the examples' values "
    "there, and program-level rules cover only a broadcast of it along the "
    "examples (an elementwise `add`/`mul`/... of a parameter broadcast over "
    "the batch, or a `concatenate` of one, such as a class token) and its "
    "use by `dot_general` (`x @ W`, `jnp.einsum`), `conv_general_dilated` "
    "(`lax.conv`), `gather` (`table[ids]`, `jnp.take`) or `dynamic_slice` "
    "with each example's values; `{primitive}` has no rule yet. Wrap the "
    "use in a tracked layer (hk.Linear, hk.Bias, ...) or write a Rule for "
    "it")

PROGRAM_NOT_PER_EXAMPLE = (
    "its output holds no axis with one example per slice (the examples "
    "are summed over, mixed or not followed there: {state}), so "
    "`{primitive}` cannot be evaluated one example at a time. Apply the "
    "parameter to each example's own values: keep the examples' axis a "
    "free axis of the `dot_general` (not a contracted "
    "one), the batch axis of a convolution, an axis of a gather's indices")

PROGRAM_OPERAND_NO_EXAMPLES = (
    "the examples' values it meets there hold no examples' axis (a scalar "
    "index, or a value shared by every example), so `{primitive}` cannot "
    "be evaluated one example at a time. Index the parameter with an "
    "array holding each example's own indices (`table[ids]`, "
    "`jnp.take(table, ids, axis=0)`), or apply it to each example's values")

PROGRAM_NOT_SEPARABLE = (
    "evaluated one example at a time (the examples' axis {axes} kept with "
    "size 1), `{primitive}` does not give its output with one slice per "
    "example: the examples' axis is one the parameter takes part in too "
    "(a batch dimension of a `dot_general` that the parameter also has, a "
    "spatial axis of a convolution). Keep the examples along an axis of "
    "the data alone (broadcast nothing of the parameter along the batch "
    "before this use)")

PROGRAM_IN_CALL = (
    "it meets the examples' values inside `{primitive}` (a while_loop, a "
    "vmapped call or another call-like primitive; jax.jit, "
    "jax.checkpoint, lax.cond/switch and lax.scan are followed inside), "
    "where program-level rules do not look: how many times, or for which "
    "example, its body runs is not known here. Apply the parameter "
    "outside that call (e.g. add the positions before the loop), write "
    "the loop as a lax.scan, or wrap its use in a tracked layer")

PROGRAM_IN_CUSTOM_DERIVATIVE = (
    "it is an operand of `{primitive}` (a function with a custom "
    "derivative, e.g. a jax.custom_jvp or jax.custom_vjp function of the "
    "data and the parameter) together with the examples' values: "
    "differentiation runs the function's own rule, not its body, and what "
    "that rule gives each example's copy of the parameter cannot be read "
    "here. Apply the parameter outside the function (f(x @ w), not "
    "f(x, w): a custom activation of the data is fine), or wrap its use "
    "in a tracked layer")

PROGRAM_BRANCH_ON_EXAMPLES = (
    "it is used inside a `{primitive}` whose branch is chosen from the "
    "examples' values (one branch for the whole batch, picked from "
    "several examples' data), so an example's gradient depends on the "
    "other examples. Choose the branch from the parameters or constants "
    "only, or per example (jax.vmap of the lax.cond, or jnp.where)")

PROGRAM_LOOP_CARRIED = (
    "it enters `{primitive}` as a loop carry or a scanned input (a learned "
    "initial state, per-step weights), where program-level rules follow "
    "only a loop's constants: each step's copy of the parameter would "
    "differ. Pass the parameter to the loop body as a constant (close "
    "over it) and, for a learned initial state, add it in the first step")

PROGRAM_TRACKED_IN_LOOP = (
    "the tracked layer that reads it as its parameter is applied inside "
    "`{primitive}` too, where the layer keeps no per-example gradients of "
    "its own to which the outside use's could be added")

PROGRAM_OUT_OF_CALL = (
    "a value computed from the parameter alone leaves `{primitive}` (a "
    "branch's or a loop's output that is not yet the examples' values), "
    "which program-level rules do not follow out. Use the parameter with "
    "the examples' values inside the branch or loop body, or compute it "
    "outside")

PROGRAM_IN_GRAM_OP = (
    "it reaches a tracked layer's input computed from the parameter alone. "
    "Wrap its use in a tracked layer of its own")

PROGRAM_BROADCAST_REDUCED = (
    "a broadcast of the parameter is reduced, reshaped or reordered by "
    "`{primitive}` before it meets the examples, so each example's share "
    "of it may depend on the batch (a sum of its copies over the batch "
    "couples the examples). Broadcast it where it meets the examples' "
    "values instead")

PROGRAM_REACHES_LOSS = (
    "it reaches the loss without meeting any one example's values (a "
    "penalty on the parameter added to the loss), a term that belongs to "
    "no example. Add the penalty's gradient outside gram_haiku, or declare "
    "the parameter frozen=")

PROGRAM_PREFIX_NOT_BOUNDED = (
    "gram_haiku.clipped_grad: parameter {params} meets the examples' "
    "values at `{primitive}`{line} through a function of the parameters "
    "alone whose VJP uses {why}, which the clipping bound cannot bound: "
    "each example's norm is taken from its gradient "
    "of that function's value pulled back through the VJP, and a sound "
    "upper bound of the true norm needs the VJP's operator norm, read "
    "equation by equation (gram_haiku/_src/analysis/linear_bound.py has a "
    "rule for casts, reshapes, sums, broadcasts, products and quotients by "
    "values of the parameters, dot products, concatenation, zero padding, "
    "select and cumsum), and a VJP linear in the cotangent.\n"
    "What to do: write that function with those operations, or freeze the "
    "parameter (frozen=...); gram_haiku.value_grad_and_gram, which needs "
    "no bound, still gives its Gram.")

PROGRAM_NO_EXAMPLES = (
    "the values it meets there could not be followed to the examples (see "
    "gram_haiku.verify), so which axis holds them is not known")

PROGRAM_EXAMPLES_MERGED = (
    "the values it meets there hold the examples merged with other "
    "positions or reordered, so its broadcast cannot be split by example")

PROGRAM_NOT_BROADCAST = (
    "the examples lie along axis {axis} there, and the parameter's value "
    "is not broadcast along that axis (it differs from example to example) "
    "or does not have one row per example")
